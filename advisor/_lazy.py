"""Lazy package surfaces (PEP 562): ``load_policy()`` pays for sqlite-utils only when it reads
the cache, and the daemon's client never loads the web framework."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_surface(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> tuple[
        Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package whose ``exports`` map each
    name to its private module (``"_store"``) or a full module name (``"policies"``); a loaded
    name is kept in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}" if module.startswith("_") else module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
