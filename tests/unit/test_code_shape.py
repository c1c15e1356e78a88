"""devtools/code_shape.py, the measure `make lint` holds the operator to, over small packages
written here: each limit it checks goes red when a package passes it."""

from __future__ import annotations

from pathlib import Path

from devtools.code_shape import MAX_CHAIN, cycles, longest_chain, measure, mixins, report


def package(root: Path, files: dict[str, str]) -> Path:
    top = root / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return top


def test_a_circle_is_found_even_behind_type_checking_and_in_a_function(tmp_path):
    shape = measure(package(tmp_path, {
        "a.py": "from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "c.py": "def f():\n    from .a import x\n",
        "d.py": "from .a import x\n"}))
    assert cycles(shape.imports) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_longest_chain_counts_modules_from_the_top(tmp_path):
    files = {f"m{i}.py": f"from .m{i + 1} import x\n" for i in range(MAX_CHAIN)}
    files[f"m{MAX_CHAIN}.py"] = "x = 1\n"
    shape = measure(package(tmp_path, files))
    assert longest_chain(shape.imports) == [f"pkg.m{i}" for i in range(MAX_CHAIN + 1)]
    assert any("import chain of 11" in failure for failure in report(shape)[1])


def test_a_class_with_methods_from_another_module_is_a_mixin_a_plain_error_is_not(tmp_path):
    shape = measure(package(tmp_path, {
        "steps.py": "class Steps:\n    def step(self):\n        pass\n"
                    "class Failed(Exception):\n    pass\n",
        "run.py": "from .steps import Failed, Steps\n"
                  "class Run(Steps):\n    def go(self):\n        self.step()\n"
                  "class Refused(Failed):\n    pass\n"}))
    assert mixins(shape) == [("pkg.run.Run", ["pkg.run", "pkg.steps"])]


def test_long_modules_and_functions_are_named(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(40))
    shape = measure(package(tmp_path, {"long.py": f"def f():\n{body}" + "y = 1\n" * 400}))
    failures = report(shape)[1]
    assert "pkg.long: 441 lines > 400" in failures
    assert "pkg.long.f: 41 lines >= 40" in failures

