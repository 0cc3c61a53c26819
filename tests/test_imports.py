"""No import cycles among the modules of producer/, worker/ and tools/, and the layers of
producer/ and worker/ import one way only: down.

The graph is read with ``ast``, not by importing: every ``import`` and ``from ... import``
anywhere in a module counts, at the top, inside a function (a lazy import hides a cycle, it does
not break one) or under ``if TYPE_CHECKING:``. ``from package import name`` is an edge to the
submodule when ``name`` is one, else to the package's ``__init__``. The implicit import of a
module's parent package is not an edge: a package that re-exports its submodules is not a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("producer", "worker", "tools")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the checked packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The known modules that module ``name`` (at ``path``) imports, wherever in the file."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base_parts = here[: len(here) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield sub
                elif base in known:
                    yield base


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {m for m in _imported(name, path, known) if m != name} for name, path in known.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_sees_the_modules_and_their_imports() -> None:
    graph = import_graph()
    assert {"producer.cli.main", "worker.config", "tools.bench.runner"} <= set(graph)
    assert "worker.errors" in graph["worker.config.settings"]


def test_cycles_are_found_wherever_the_import_is() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


#: Each package's layers, lowest first: a folder (or a top-level module) may import from the
#: layers below it and from itself, never from a layer above it or beside it. ``producer`` never
#: imports ``worker``; ``worker`` may import any of ``producer``.
LAYERS: dict[str, list[tuple[str, ...]]] = {
    "producer": [
        ("protocol",),
        ("redisio",),
        ("client",),
        ("jobs", "ops"),
        ("cli",),
        ("__init__", "__main__"),
    ],
    "worker": [
        ("errors", "events"),
        ("config",),
        ("model",),
        ("redisio",),
        ("items",),
        ("intake",),
        ("pipeline",),
        ("answer",),
        ("ops",),
        ("warmup",),
        ("service",),
        ("fleet",),
        ("cli",),
        ("__init__", "__main__"),
    ],
}


def unit_of(module: str) -> tuple[str, str]:
    """A module's package and its layer unit: the folder it lives in, or its own name at the
    top (``producer`` itself is the unit ``__init__``)."""
    package, _, rest = module.partition(".")
    return package, rest.split(".")[0] or "__init__"


def rank(module: str) -> int:
    package, unit = unit_of(module)
    for level, units in enumerate(LAYERS[package]):
        if unit in units:
            return level
    raise AssertionError(f"{module} is in no layer of {package}: add its folder to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up or sideways in the layers, as ``a -> b``."""
    found = []
    for module, imported in sorted(graph.items()):
        if module.split(".")[0] not in LAYERS:
            continue
        for target in sorted(imported):
            if target.split(".")[0] not in LAYERS:
                continue
            if unit_of(module)[0] != unit_of(target)[0]:
                if unit_of(module)[0] == "producer":
                    found.append(f"{module} -> {target}")
                continue
            if unit_of(module) != unit_of(target) and rank(target) >= rank(module):
                found.append(f"{module} -> {target}")
    return found


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        if module.split(".")[0] in LAYERS:
            rank(module)


def test_an_upward_or_sideways_import_is_found() -> None:
    graph = {
        "producer.protocol.codec": {"producer.client.blocking"},
        "producer.jobs.job": {"producer.ops.status"},
        "producer.client.blocking": {"producer.protocol.codec", "producer.client.plans"},
        "producer.cli.main": {"worker.config"},
        "worker.model.schema": {"worker.intake.admit"},
        "worker.intake.admit": {"worker.model.schema", "producer.protocol.codec"},
    }
    assert upward_imports(graph) == [
        "producer.cli.main -> worker.config",
        "producer.jobs.job -> producer.ops.status",
        "producer.protocol.codec -> producer.client.blocking",
        "worker.model.schema -> worker.intake.admit",
    ]


def test_imports_point_down_the_layers() -> None:
    found = upward_imports(import_graph())
    assert not found, "imports against the layer order:\n" + "\n".join(found)


if __name__ == "__main__":
    for line in upward_imports(import_graph()):
        print(line)
    for component in cycles(import_graph()) or [["no cycles"]]:
        print(" <-> ".join(component))
