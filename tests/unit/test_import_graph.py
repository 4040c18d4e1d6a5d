"""The import graph of advisor, probes and policies has no cycles, and arrows point one way.

The graph is read from the source (AST), so it sees every import: module level, inside
functions, and ``importlib.import_module`` calls with a literal name. Only imports under
``if TYPE_CHECKING:`` are left out: they never run, and annotations may name any type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("advisor", "probes", "policies")

# Which top-level package may import which (DESIGN.md, "Layout"): advisor uses probes and
# policies; policies may use probes; probes uses neither.
ALLOWED = {"probes": {"probes"}, "policies": {"policies", "probes"}, "advisor": set(PACKAGES)}
# Inside advisor: which subpackage may import which. A module directly under advisor/ is
# named by its own name. Leaves (_log, _paths, _version) are open to all.
ADVISOR_LAYERS = {
    "runtime": {"runtime"},
    "cache": {"cache"},
    "tune": {"tune", "trial", "runtime", "cache"},
    "_load": {"runtime", "trial", "tune", "cache"},
    "_hardware": set(),
    "daemon": {"daemon", "cache", "tune", "trial", "_hardware", "frameworks"},
    "frameworks": {"frameworks", "tune", "trial", "runtime"},
    "trial": {"trial", "runtime"},
    "cli": {"cli", "cache", "daemon", "tune", "trial", "runtime", "_load", "_hardware", "frameworks"},
    "__init__": {"_load", "runtime", "tune"},
}
ADVISOR_LEAVES = {"_entry", "_log", "_paths", "_secure", "_version"}


def module_names() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node except those inside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` imports, each resolved to the module it names."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # `import a.b.c` binds a name from a, but the module executed is a.b.c; resolve to
        # the longest project module the name denotes.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import submodule` imports the submodule; `from mod import name`
                # imports mod.
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else source)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_function_local_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import advisor._log\n"
        "def f():\n    from advisor._paths import cache_dir\n"
    )
    assert imports_of("advisor.m", module, module_names()) == {"advisor._paths"}


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert find_cycles(graph) == []


def test_top_level_packages_import_downwards_only(graph: dict[str, set[str]]) -> None:
    wrong = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[source.split(".")[0]]
    )
    assert wrong == []


def _advisor_layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_advisor_subpackages_import_downwards_only(graph: dict[str, set[str]]) -> None:
    wrong = []
    for source, targets in graph.items():
        if not source.startswith("advisor"):
            continue
        layer = _advisor_layer(source)
        allowed = ADVISOR_LAYERS.get(layer, set()) | ADVISOR_LEAVES | {layer}
        for target in targets:
            if target.startswith("advisor") and _advisor_layer(target) not in allowed:
                wrong.append(f"{source} -> {target}")
    assert sorted(wrong) == []


def test_every_advisor_layer_is_placed() -> None:
    layers = {_advisor_layer(name) for name in module_names() if name.startswith("advisor")}
    assert layers <= set(ADVISOR_LAYERS) | ADVISOR_LEAVES


def test_every_module_imports() -> None:
    """Each module loads on its own, so a name that moved is found here and not in a subprocess."""
    import importlib

    for name in sorted(module_names()):
        if name == "advisor.cli.__main__":
            continue  # runs the CLI
        importlib.import_module(name)
