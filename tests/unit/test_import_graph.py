"""The import graph of advisor, probes and policies has no cycles, and arrows point one way;
and packages meet only through each other's public surface, their ``__init__``.

The graph is read from the source (AST), so it sees every import: module level, inside
functions, and ``importlib.import_module`` calls with a literal name. Only imports under
``if TYPE_CHECKING:`` are left out: they never run, and annotations may name any type.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
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
    "frameworks": {"frameworks", "tune", "trial", "runtime", "cache"},
    "trial": {"trial", "runtime"},
    "cli": {"cli", "cache", "daemon", "tune", "trial", "runtime", "_load", "_hardware", "frameworks"},
    "__init__": {"_load", "runtime", "tune"},
}
ADVISOR_LEAVES = {"_entry", "_lazy", "_log", "_paths", "_secure", "_version"}


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


def package_of(name: str, path: Path) -> str:
    """The package a module belongs to: itself for a package's ``__init__``."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def import_statements(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, str | None, int]]:
    """Each import in ``name``'s source as ``(module, attribute, line)``: the dotted module it
    names (made absolute), the name a ``from module import name`` takes from it (``None``
    where that name is a module itself, or for a plain ``import``), and its line."""
    package = package_of(name, path)
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
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
                if submodule in modules:
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, None, node.lineno


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` imports, each resolved to the module it names."""
    found: set[str] = set()
    for target, _, _ in import_statements(name, path, modules):
        # `import a.b.c` binds a name from a, but the module executed is a.b.c; resolve to
        # the longest project module the name denotes.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
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


# ---- public surfaces ---------------------------------------------------------------------------
# A package's surface is its `__init__`: a module of package P may import a private module
# (`Q._m`, any dotted part that starts with one underscore) only when P is Q or lies inside Q,
# so advisor.tune may import advisor._log, but not advisor.cache._store, probes._bench or
# policies._config; and it may import a private name (`from X import _name`) only from a
# module of its own package.



def private_module(dotted: str) -> tuple[str, str] | None:
    """The first private module on a dotted path, and the package whose own it is:
    ``"advisor.cache._store.Store"`` -> ``("advisor.cache._store", "advisor.cache")``."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[: i + 1]), ".".join(parts[:i])
    return None


def _inside(package: str, owner: str) -> bool:
    return package == owner or package.startswith(owner + ".")


def surface_violations(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Imports of ``name`` that bypass another package's surface: ``"<target>"`` for a private
    module, ``"<module>:<name>"`` for a private name."""
    package = package_of(name, path)
    wrong = []
    for target, attribute, _ in import_statements(name, path, modules):
        if target.split(".")[0] not in PACKAGES:
            continue
        found = private_module(target)
        if found is not None and not _inside(package, found[1]):
            wrong.append(target)
        if attribute is not None and attribute.startswith("_") and not attribute.startswith("__"):
            owner = target if target in modules and modules[target].name == "__init__.py" else target.rpartition(".")[0]
            if package != owner:
                wrong.append(f"{target}:{attribute}")
    return wrong


def all_surface_violations() -> dict[str, set[str]]:
    modules = module_names()
    found: dict[str, set[str]] = {}
    for name, path in sorted(modules.items()):
        wrong = surface_violations(name, path, modules)
        if wrong:
            found[path.relative_to(ROOT).as_posix()] = set(wrong)
    return found


def test_the_surface_rule_finds_private_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import importlib\n"
        "from advisor._log import get_logger\n"  # a leaf of advisor: open to its subpackages
        "from advisor.tune._space import SpaceLimits\n"  # its own package
        "from advisor.cache import Store\n"  # a surface
        "from advisor.cache._store import open_store\n"
        "def f():\n    import probes._bench\n    from advisor.trial._child import _exit\n"
        "importlib.import_module('policies._config')\n"
    )
    assert sorted(surface_violations("advisor.tune.m", module, module_names())) == [
        "advisor.cache._store", "advisor.trial._child", "advisor.trial._child:_exit", "policies._config", "probes._bench",
    ]
    assert "advisor._log" in surface_violations("policies.m", module, module_names())


def test_packages_meet_through_their_surface() -> None:
    found = {f: sorted(t) for f, t in all_surface_violations().items() if t}
    assert found == {}, "import these names from the package's __init__ (export them there if they are missing)"


def test_no_private_name_is_imported_from_another_package() -> None:
    names = {f: sorted(t for t in targets if ":" in t) for f, targets in all_surface_violations().items()}
    assert {f: t for f, t in names.items() if t} == {}


@pytest.mark.parametrize("package", [
    "probes", "policies", "advisor", "advisor.runtime", "advisor.trial", "advisor.cache", "advisor.daemon",
    "advisor.cli",
])
def test_every_exported_name_resolves(package: str) -> None:
    """``__all__`` lists the surface; each name in it is there, lazy exports included."""
    surface = importlib.import_module(package)
    assert [name for name in surface.__all__ if not hasattr(surface, name)] == []
