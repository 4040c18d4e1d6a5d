"""Which training framework a script drives, read from its imports (no import runs).

A script that imports advisor uses the loop API. Otherwise each adapter class's
``detected_by`` names the imports (``from lightning.pytorch import Trainer``) and module
attributes (``L.Trainer``) that mean it; between two, the lower ``precedence`` wins.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from probes import MpadviseError

from ._registry import detection_order

LOOP_API = "advisor"  # what detection returns for a script written against the loop API


@dataclass
class _Imports:
    """What one source imports: the loop API, the frameworks it names, and the modules."""

    loop_api: bool = False
    found: set[str] = field(default_factory=set)
    modules: list[tuple[str, ...]] = field(default_factory=list)


def detect_framework(source: str | bytes) -> str | None:
    """The framework a script's source trains with, ``LOOP_API``, or ``None`` (pure)."""
    return _decide([_read(source)])


def detect_script_framework(script: Path) -> str | None:
    """As ``detect_framework``, also reading the modules beside the script that it imports."""
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise MpadviseError(f"cannot read script {script}: {exc.strerror or exc}") from None
    imports = _read(source)
    if imports is None:
        return None
    found = [imports]
    for path in _sibling_modules(script.parent, imports.modules):
        with contextlib.suppress(OSError):
            found.append(_read(path.read_bytes()))
    # No framework named: the adapter for a script that imports none (plain torch).
    fallback = next((cls.name for cls in detection_order() if getattr(cls, "fallback", False)), None)
    return _decide(found) or fallback


def _decide(imports: Iterable[_Imports | None]) -> str | None:
    seen = [i for i in imports if i is not None]
    if any(i.loop_api for i in seen):
        return LOOP_API
    found = set().union(*(i.found for i in seen))
    return next((cls.name for cls in detection_order() if cls.name in found), None)


def _read(source: str | bytes) -> _Imports | None:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    meanings: dict[str, dict[str, str]] = {}  # module -> imported name -> framework
    for cls in detection_order():
        for module, names in cls.detected_by.items():
            for name in names:
                meanings.setdefault(module, {}).setdefault(name, cls.name)
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
    """Frameworks used as an attribute of an imported module: ``L.Trainer``, ``L.pytorch.Trainer``."""
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
    """``helpers.py``, ``pkg/__init__.py`` and ``pkg/helpers.py`` in ``directory`` that these imports name."""
    paths: dict[Path, None] = {}
    for parts in modules:
        for depth in range(1, len(parts) + 1):
            base = directory.joinpath(*parts[:depth])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    paths[path] = None
    return list(paths)
