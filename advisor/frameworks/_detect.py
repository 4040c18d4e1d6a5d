"""Which training framework a script drives, read from its imports (no import runs).

A script that imports advisor is served by the loop API (``load_policy()``), whatever else it
imports. Otherwise the framework whose trainer the script uses decides. Which imports mean
which framework is each adapter class's ``detected_by`` (module -> names), read from the
registry on every call, for names imported from a module (``from lightning.pytorch.trainer
import Trainer``) and for attributes of an imported module (``L.Trainer``,
``lightning.pytorch.Trainer``). A script that uses two (a Lightning Trainer and an HF model,
an HF Trainer and Accelerate) is decided by the classes' ``precedence``: the trainer that runs
the loop before the Fabric or Accelerator it is built on.

``detect_framework(source)`` reads one source text (pure). ``detect_script_framework(path)``
also reads the modules of the script's own directory that it imports, one level deep, so that
a Fabric, Trainer or Accelerator built in a helper module beside the script is found too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from probes import MpadviseError

from ._registry import detection_order

LOOP_API = "advisor"
"""What ``detect_framework`` returns for a script written against mpadvise's own loop API."""


@dataclass
class _Imports:
    """What one source imports: whether it uses the loop API, the frameworks it names, and the
    top-level modules it imports (for the helper modules beside a script)."""

    loop_api: bool = False
    found: set[str] = field(default_factory=set)
    modules: list[tuple[str, ...]] = field(default_factory=list)


def detect_framework(source: str | bytes) -> str | None:
    """The framework a script trains with, ``"advisor"`` for the loop API, or ``None``.

    Args:
        source: the script's source text.

    Returns:
        A registered framework's name, ``LOOP_API``, or ``None`` when none is recognised (a
        plain torch script that never calls ``load_policy()``) or the source does not parse.
    """
    imports = _read(source)
    return None if imports is None else _decide([imports])


def detect_script_framework(script: Path) -> str | None:
    """As ``detect_framework`` for the script at ``script``, also reading the modules of its own
    directory that it imports (one level deep: a helper module's own imports of further helpers
    are not followed). Nothing is run. A script that parses, names no framework and never
    imports advisor gets the fallback adapter (``"torch"``, the plain PyTorch loop); one that
    does not parse gets ``None`` (it runs as it is, and fails as it would).

    Raises:
        MpadviseError: the script cannot be read.
    """
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise MpadviseError(f"cannot read script {script}: {exc.strerror or exc}") from None
    imports = _read(source)
    if imports is None:
        return None
    found = [imports]
    for path in _sibling_modules(script.parent, imports.modules):
        try:
            helper = _read(path.read_bytes())
        except OSError:
            continue
        if helper is not None:
            found.append(helper)
    # A script that names no framework and never imports advisor trains with plain torch.
    return _decide(found) or fallback_framework()


def _decide(imports: Iterable[_Imports]) -> str | None:
    seen = list(imports)
    if any(i.loop_api for i in seen):
        return LOOP_API
    found = set().union(*(i.found for i in seen))
    return next((cls.name for cls in detection_order() if cls.name in found), None)


def fallback_framework() -> str | None:
    """The registered adapter that runs a script naming no framework (plain torch), or ``None``."""
    return next((cls.name for cls in detection_order() if getattr(cls, "fallback", False)), None)


def _meanings() -> dict[str, dict[str, str]]:
    """module -> imported name -> framework, from the registered classes (first by precedence wins)."""
    table: dict[str, dict[str, str]] = {}
    for cls in detection_order():
        for module, names in cls.detected_by.items():
            for name in names:
                table.setdefault(module, {}).setdefault(name, cls.name)
    return table


def _read(source: str | bytes) -> _Imports | None:
    """What ``source`` imports, or ``None`` where it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    meanings = _meanings()
    imports = _Imports()
    aliases: dict[str, str] = {}  # local name of an imported module -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.loop_api |= _is_loop_api(alias.name)
                # `import a.b.c` binds `a`; `import a.b.c as x` binds x to a.b.c.
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
                imports.modules.append(tuple(alias.name.split(".")))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imports.loop_api |= _is_loop_api(node.module)
            names = meanings.get(node.module, {})
            for alias in node.names:
                if alias.name in names:
                    imports.found.add(names[alias.name])
                else:  # from lightning import pytorch as pl; from helpers import fabric_setup
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                imports.modules.append((*node.module.split("."), alias.name))
    imports.found.update(_attribute_uses(tree, aliases, meanings))
    return imports


def _is_loop_api(module: str) -> bool:
    return module == LOOP_API or module.startswith(LOOP_API + ".")


def _attribute_uses(tree: ast.AST, aliases: Mapping[str, str], meanings: Mapping[str, Mapping[str, str]]) -> Iterable[str]:
    """Frameworks used as an attribute of an imported module: ``L.Trainer``, ``L.pytorch.Trainer``,
    ``lightning.pytorch.trainer.Trainer``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts: list[str] = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            module = ".".join([aliases[value.id], *reversed(parts)])
            meaning = meanings.get(module, {}).get(node.attr)
            if meaning is not None:
                yield meaning


def _sibling_modules(directory: Path, modules: Iterable[tuple[str, ...]]) -> list[Path]:
    """The source files in ``directory`` that these imports name: ``helpers.py``, a package's
    ``__init__.py``, or a module inside a package of that directory (``pkg/helpers.py``)."""
    paths: dict[Path, None] = {}
    for parts in modules:
        for depth in range(1, len(parts) + 1):
            base = directory.joinpath(*parts[:depth])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    paths[path] = None
    return list(paths)
