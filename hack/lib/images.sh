# Sourced by the scripts that build, load or deploy the project's images (ROOT set first): their
# names, one place. REGISTRY defaults to ghcr.io/accelerate-operator, TAG to pyproject's version.
REGISTRY="${REGISTRY:-ghcr.io/accelerate-operator}"
TAG="${TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1)}"
