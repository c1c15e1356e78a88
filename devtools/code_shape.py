"""The shape of the operator's code, measured from its import graph and syntax tree: what a
reader feels before reading a line of it. `make lint` runs it with `--check`, which fails when
one of these limits is passed:

- no import circle among the modules of a package (TYPE_CHECKING and in-function imports
  count: a circle hidden from the interpreter is still one for the reader);
- no import chain longer than MAX_CHAIN modules (the longest path down the graph, the entry
  point included);
- no class whose methods live in more than one file (mixins sharing `self` across modules);
- no module over MAX_MODULE_LINES lines;
- no function of MAX_FUNCTION_LINES lines or more (its `def` to its last line).

`python -m devtools.code_shape [--check] [package dir...]` prints every measure; the packages
default to operator/accelerate_operator and operator/accelerate_job."""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "operator" / "accelerate_operator", ROOT / "operator" / "accelerate_job")
MAX_CHAIN = 10
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 40


@dataclass
class Shape:
    """What was measured of one package."""

    package: str
    modules: dict[str, Path] = field(default_factory=dict)
    imports: dict[str, set[str]] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    functions: list[tuple[str, str, int]] = field(default_factory=list)  # module, name, lines
    # "module.Class": (module, base names as written, whether it defines methods)
    classes: dict[str, tuple[str, list[str], bool]] = field(default_factory=dict)


def module_name(package: Path, path: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module an `from ... import` names, made absolute."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported(module: str, is_package: bool, tree: ast.AST, known: Iterable[str]) -> set[str]:
    """The package's own modules that `tree` imports (`from . import x` names module x)."""
    known, found = set(known), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from pkg import mod` imports the module mod; `from mod import name`, mod.
            target = _absolute(module, is_package, node)
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _functions(module: str, tree: ast.AST) -> Iterable[tuple[str, str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield module, node.name, node.end_lineno - node.lineno + 1


def _classes(tree: ast.Module) -> Iterable[tuple[str, list[str], bool]]:
    """(class, base names as written, whether it defines methods) of every top-level class."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = any(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for item in node.body)
            yield node.name, [ast.unparse(base) for base in node.bases], methods


def measure(package: Path) -> Shape:
    shape = Shape(package.name)
    paths = sorted(package.rglob("*.py"))
    shape.modules = {module_name(package, path): path for path in paths}
    for name, path in shape.modules.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        shape.lines[name] = len(text.splitlines())
        shape.imports[name] = imported(name, path.name == "__init__.py", tree, shape.modules)
        shape.functions.extend(_functions(name, tree))
        for cls, bases, methods in _classes(tree):
            shape.classes[f"{name}.{cls}"] = (name, bases, methods)
    return shape


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def longest_chain(graph: Mapping[str, set[str]]) -> list[str]:
    """The longest import chain (modules, the importer first), circles cut where first met."""
    @cache
    def chain(node: str, path: frozenset[str]) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in path:
                below = chain(nxt, path | {nxt})
                if len(below) > len(best):
                    best = below
        return (node, *best)

    return list(max((chain(n, frozenset({n})) for n in sorted(graph)), key=len, default=()))


def mixins(shape: Shape) -> list[tuple[str, list[str]]]:
    """Classes that inherit methods from a class of the package defined in another module."""
    by_name: dict[str, list[str]] = {}
    for qualified in shape.classes:
        by_name.setdefault(qualified.rpartition(".")[2], []).append(qualified)
    found = []
    for qualified, (module, bases, _) in shape.classes.items():
        files = {module}
        for base in bases:
            for other in by_name.get(base.rpartition(".")[2], []):
                where, _, methods = shape.classes[other]
                if other != qualified and methods and where in shape.imports[module]:
                    files.add(where)
        if len(files) > 1:
            found.append((qualified, sorted(files)))
    return found


def report(shape: Shape) -> tuple[list[str], list[str]]:
    """(lines to print, limits passed)."""
    circles = cycles(shape.imports)
    chain = longest_chain(shape.imports)
    spread = mixins(shape)
    big = sorted(((n, m) for m, n in shape.lines.items() if n > MAX_MODULE_LINES), reverse=True)
    long = sorted(((n, f"{m}.{f}") for m, f, n in shape.functions if n >= MAX_FUNCTION_LINES),
                  reverse=True)
    lines = [f"{shape.package}: {len(shape.modules)} modules, "
             f"{sum(shape.lines.values())} lines",
             f"  import circles: {len(circles)} {circles if circles else ''}".rstrip(),
             f"  longest import chain: {len(chain)} modules: {' -> '.join(chain)}",
             f"  classes whose methods live in more than one file: {len(spread)} {spread or ''}"
             .rstrip(),
             f"  largest module: {max(shape.lines.values(), default=0)} lines; "
             f"over {MAX_MODULE_LINES}: "
             f"{big or 'none'}",
             f"  longest function: {max((n for *_, n in shape.functions), default=0)} lines; "
             f"{MAX_FUNCTION_LINES} or more: {long or 'none'}"]
    passed = ([f"{shape.package}: import circle {c}" for c in circles]
              + ([f"{shape.package}: import chain of {len(chain)} > {MAX_CHAIN}"]
                 if len(chain) > MAX_CHAIN else [])
              + [f"{shape.package}: class {c} has methods in {f}" for c, f in spread]
              + [f"{m}: {n} lines > {MAX_MODULE_LINES}" for n, m in big]
              + [f"{f}: {n} lines >= {MAX_FUNCTION_LINES}" for n, f in long])
    return lines, passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a limit is passed")
    parser.add_argument("packages", nargs="*", type=Path, default=list(PACKAGES))
    args = parser.parse_args(argv)
    failures = []
    for package in args.packages:
        lines, passed = report(measure(package))
        print("\n".join(lines))
        failures += passed
    if args.check and failures:
        print("\ncode shape limits passed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
