"""Which training framework a script drives, read from its imports (pure: no import runs).

A script that imports advisor is served by the loop API (``load_policy()``), whatever else it
imports. Otherwise the framework whose trainer the script uses decides:

* ``lightning``: ``Trainer`` from ``lightning``/``lightning.pytorch``/``pytorch_lightning``;
* ``fabric``: ``Fabric`` from ``lightning``/``lightning.fabric``/``lightning_fabric``;
* ``transformers``: ``Trainer`` (or a subclass such as ``Seq2SeqTrainer``) from transformers;
* ``accelerate``: ``Accelerator`` from accelerate.

A script that uses two of them (a Lightning Trainer and an HF model) is decided in that order
of precedence for the trainer that runs the loop: Lightning's and HF's trainers before Fabric
and Accelerate, which the others are built on.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

FRAMEWORKS: tuple[str, ...] = ("lightning", "fabric", "transformers", "accelerate")
"""The frameworks whose unmodified scripts mpadvise can tune and run."""

LOOP_API = "advisor"
"""What ``detect_framework`` returns for a script written against mpadvise's own loop API."""

# Names imported from these modules, and what they mean. A module listed without names means
# "the module itself" (``import lightning as L`` then ``L.Trainer``).
_TRAINERS: dict[str, dict[str, str]] = {
    "lightning": {"Trainer": "lightning", "Fabric": "fabric"},
    "lightning.pytorch": {"Trainer": "lightning"},
    "pytorch_lightning": {"Trainer": "lightning"},
    "lightning.fabric": {"Fabric": "fabric"},
    "lightning_fabric": {"Fabric": "fabric"},
    "transformers": {"Trainer": "transformers", "Seq2SeqTrainer": "transformers"},
    "accelerate": {"Accelerator": "accelerate"},
}
_PRECEDENCE = ("lightning", "transformers", "fabric", "accelerate")


def detect_framework(source: str | bytes) -> str | None:
    """The framework a script trains with, ``"advisor"`` for the loop API, or ``None``.

    Args:
        source: the script's source text.

    Returns:
        One of ``FRAMEWORKS``, ``LOOP_API``, or ``None`` when none is recognised (a plain
        torch script that never calls ``load_policy()``) or the source does not parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    found: set[str] = set()
    aliases: dict[str, str] = {}  # local name of an imported module -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == LOOP_API or alias.name.startswith(LOOP_API + "."):
                    return LOOP_API
                if alias.name in _TRAINERS:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == LOOP_API or node.module.startswith(LOOP_API + "."):
                return LOOP_API
            names = _TRAINERS.get(node.module, {})
            for alias in node.names:
                if alias.name in names:
                    found.add(names[alias.name])
                elif f"{node.module}.{alias.name}" in _TRAINERS:  # from lightning import pytorch as pl
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found.update(_attribute_uses(tree, aliases))
    return next((name for name in _PRECEDENCE if name in found), None)


def _attribute_uses(tree: ast.AST, aliases: dict[str, str]) -> Iterable[str]:
    """Frameworks used as ``L.Trainer(...)`` or ``pl.Trainer``: an attribute of an imported module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module is not None:
                meaning = _TRAINERS[module].get(node.attr)
                if meaning is not None:
                    yield meaning
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name):
            module = aliases.get(node.value.value.id)
            if module is not None:  # L.pytorch.Trainer, L.fabric.Fabric
                meaning = _TRAINERS.get(f"{module}.{node.value.attr}", {}).get(node.attr)
                if meaning is not None:
                    yield meaning
