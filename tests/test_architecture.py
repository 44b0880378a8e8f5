"""The package's imports point one way: down the table of layers in docs/architecture.md.

Every ``import`` in ``fshard/``, ``backends/`` (installed as ``fshard.backends``) and
``benchmarks/`` (``fshard.benchmarks``) is read from the source, function-level ones
included. The tests fail on

- an import cycle among modules, counting imports under ``if TYPE_CHECKING:`` too (a
  reader follows them like any other);
- an import that points up the table of layers;
- a function-level import of another fshard module that is not listed, with its
  reason, in ``DEFERRED``.

Run this file's ``report()`` (``python tests/test_architecture.py``) to print the graph's
numbers: modules, cycles, upward edges and deferred imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's source lives in the repository.
SOURCES = {"fshard": ROOT / "fshard", "fshard.backends": ROOT / "backends", "fshard.benchmarks": ROOT / "benchmarks"}

# The layers, lowest first: a module may import its own layer's modules and those below.
# A module takes the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("fshard._errors", "fshard._config", "fshard._log", "fshard._base"),
    ("fshard._layout",),
    ("fshard._plan",),
    ("fshard.backends",),
    ("fshard._array",),
    ("fshard._exec",),
    ("fshard._api", "fshard._interop"),
    ("fshard._checkpoint", "fshard.testing"),
    ("fshard", "fshard.__main__", "fshard._cli", "fshard._demo", "fshard.benchmarks"),
)

# Function-level imports of fshard modules, each with the reason it cannot sit at the top.
DEFERRED: dict[tuple[str, str], str] = {
    ("fshard.__main__", "fshard._demo"): "the demo imports the whole package; `fshard --version` should not",
    ("fshard.__main__", "fshard.benchmarks.run"): "the benchmarks need the optional `bench` extra",
    ("fshard.backends", "fshard.backends.torch_dist"): "torch.distributed is loaded only when a group is used",
}


@dataclass(frozen=True)
class Edge:
    """One import statement: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    deferred: bool  # inside a function body
    typing_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    for package, folder in SOURCES.items():
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


def _files() -> Iterator[Path]:
    for folder in SOURCES.values():
        yield from sorted(folder.rglob("*.py"))


MODULES = {_module_name(path): path for path in _files()}


def _resolve(name: str) -> str | None:
    """The fshard module that ``import name`` loads, or None for an outside module."""
    if name == "benchmarks" or name.startswith("benchmarks."):  # the folder put on sys.path by hand
        name = f"fshard.{name}"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base]) if base else ".".join(anchor)
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, deferred: bool, typing_only: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, deferred, typing_only
        inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner, typing_only or (isinstance(child, ast.If) and _is_type_checking(child)))


def edges() -> list[Edge]:
    """Every import of one fshard module by another, in source order."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, deferred, typing_only in _walk(tree, False, False):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _targets(node, module, path.name == "__init__.py"):
                    target = _resolve(name)
                    if target is not None and target != module:
                        found.append(Edge(module, target, node.lineno, deferred, typing_only))
    return found


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``module``."""
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best


def cycles(graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    succ: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in graph:
        succ[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return sorted(found)


def upward(graph: list[Edge]) -> list[Edge]:
    """Imports whose target sits in a higher layer than their source."""
    return [e for e in graph if layer(e.target) > layer(e.source)]


def deferred(graph: list[Edge]) -> list[Edge]:
    """Function-level imports of fshard modules."""
    return [e for e in graph if e.deferred and not e.typing_only]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer(module)


def test_no_import_cycle():
    assert cycles(edges()) == []


def test_no_import_points_up_the_layers():
    assert [f"{e.source}:{e.line} -> {e.target}" for e in upward(edges())] == []


def test_function_level_imports_are_listed_with_a_reason():
    found = {(e.source, e.target) for e in deferred(edges())}
    assert sorted(found - set(DEFERRED)) == []
    assert sorted(set(DEFERRED) - found) == [], "DEFERRED lists imports that are gone: remove them"


def test_the_walk_sees_function_level_and_type_checking_imports():
    graph = edges()
    assert Edge("fshard.__main__", "fshard._demo", _line("fshard.__main__", "fshard._demo"), True, False) in graph
    assert any(e.typing_only for e in graph)


def _line(source: str, target: str) -> int:
    return next(e.line for e in edges() if e.source == source and e.target == target)


def report() -> str:
    """The numbers: modules, cycles (modules in them), upward edges, deferred imports, modules over 400 lines."""
    graph = edges()
    found = cycles(graph)
    long = [m for m, p in MODULES.items() if len(p.read_text().splitlines()) > 400]
    return "\n".join(
        [
            f"modules: {len(MODULES)}",
            f"cycles: {len(found)} ({sum(map(len, found))} modules)",
            *(f"  {' '.join(c)}" for c in found),
            f"upward edges: {len(upward(graph))}",
            f"deferred imports of fshard modules: {len(deferred(graph))}",
            f"modules over 400 lines: {len(long)} {sorted(long)}",
        ]
    )


if __name__ == "__main__":
    print(report())
