"""Pure builders: one module per child kind, each `build_<kind>(job, ...) -> dict` manifest."""
