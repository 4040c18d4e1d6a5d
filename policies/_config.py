"""The Policy, a frozen, validated description of how to train, and its config file on disk."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from probes import MpadviseError, UsageError, check_writable, read_trusted_text, write_file_atomic

from ._policy_data import config_text, parse_config_text, policy_dict, policy_fields
from ._policy_parts import (
    Fp8Options,
    LossScale,
    PolicyError,
    TunedOn,
    check_choice,
    check_policy,
)
from ._registry import mode_class, mode_names


@dataclass(frozen=True)
class Policy:
    """How to train: precision mode, loss scaling, batch split and FP8 options; frozen, hashable.

    ``loss_scale`` defaults to dynamic scaling for the modes that scale the loss and is allowed
    only there. ``micro_batch_size``/``grad_accum_steps`` ``None`` keep the script's global
    batch. ``reduce_dtype`` is read by ``AppliedPolicy.fsdp_mixed_precision()`` only (``None``:
    ``default_reduce_dtype``).
    """

    mode: str = "fp32"
    loss_scale: LossScale | None = None
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    grad_clip_norm: float | None = None
    fp8: Fp8Options | None = None
    reduce_dtype: str | None = None
    tuned_on: TunedOn | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, mode_names())
        if mode_class(self.mode).loss_scaling and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())
        check_policy(self)

    @property
    def uses_loss_scaling(self) -> bool:
        return self.loss_scale is not None and self.loss_scale.kind != "none"

    def with_(self, **changes: Any) -> Policy:
        return replace(self, **changes)

    def describe(self) -> str:
        """One short line for people: ``fp16-mixed (dynamic loss scale 65536), micro-batch 32 x 2``."""
        parts = [self.mode]
        if self.uses_loss_scaling:
            ls = self.loss_scale
            assert ls is not None
            parts.append(f"({ls.kind} loss scale {ls.init_scale:g})")
        if self.fp8 is not None and self.fp8.recipe:
            parts.append(f"(recipe {self.fp8.recipe})")
        if self.reduce_dtype is not None:
            parts.append(f"(reduce in {self.reduce_dtype})")
        if self.micro_batch_size is not None:
            accum = f" x {self.grad_accum_steps}" if self.grad_accum_steps else ""
            parts.append(f"micro-batch {self.micro_batch_size}{accum}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return policy_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> Policy:
        """Inverse of ``to_dict``; a PolicyError names ``source``, the field and what is allowed."""
        values = policy_fields(data, source=source, known={f.name for f in fields(cls)})
        try:
            return cls(**values)
        except (PolicyError, TypeError) as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def to_toml(self, *, framework: str | None = None) -> str:
        """The config file text; with ``framework`` (a script that never imports advisor), its
        header says to run the script with ``mpadvise run``."""
        return config_text(self.to_dict(), framework=framework)

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>") -> Policy:
        return cls.from_dict(parse_config_text(text, source=source), source=source)

    def save(self, path: str | Path, *, framework: str | None = None, force: bool = False) -> Path:
        """Write the config file atomically. An existing ``path`` is replaced only when it is a
        config file mpadvise can read, or with ``force``: a training script there is refused."""
        path = Path(path)
        if not force:
            _check_replaceable(path)
        try:
            write_file_atomic(path, self.to_toml(framework=framework))
        except OSError as exc:
            raise MpadviseError(f"cannot write config file {path}: {exc.strerror or exc}") from None
        return path


def check_config_target(path: str | Path) -> Path:
    """Refuse now, as a usage error, a config file path that :meth:`Policy.save` would refuse
    or fail on at the end of a tune."""
    path = Path(path)
    try:
        _check_replaceable(path)
        return check_writable(path, "config file")
    except MpadviseError as exc:
        raise UsageError(str(exc)) from None


def _check_replaceable(path: Path) -> None:
    if not os.path.lexists(path) or os.path.islink(path):
        return  # a symlink is replaced by the new file; what it points to stays as it was
    if path.is_dir():
        raise MpadviseError(f"cannot write config file {path}: it is a directory")
    if not path.is_file():
        raise MpadviseError(f"refusing to replace {path} with a config file: it is not a regular file")
    try:
        Policy.from_toml(path.read_text(encoding="utf-8"), source=str(path))
        return
    except (OSError, UnicodeDecodeError, MpadviseError):
        pass
    raise MpadviseError(
        f"refusing to replace {path} with a config file: it exists and is not an mpadvise config file; "
        "name a new .toml file (the default is <script>.mpadvise.toml beside the script)"
    )


def load_config(path: str | Path) -> Policy:
    """Read and validate a config file, refusing one another user wrote or could have (it
    applies a precision to the user's training); a PolicyError names the file and the problem."""
    path = Path(path)
    try:
        text = read_trusted_text(path, what="config file")
    except IsADirectoryError:
        raise PolicyError(f"config file {path} is a directory, expected a .toml file") from None
    except MpadviseError as exc:
        raise PolicyError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise PolicyError(f"cannot read config file {path}: {reason}") from None
    return Policy.from_toml(text, source=str(path))
