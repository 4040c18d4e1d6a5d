"""The Policy: a frozen, validated description of how to train, and its TOML config file.

Its parts and their checks are :mod:`policies._policy_parts`; its dict and TOML forms
:mod:`policies._policy_data`. This module holds the Policy and the config file on disk:
writing it where it may replace what is there, and reading one that is trusted.
"""

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
    """How to train: precision mode, loss scaling, batch split and FP8 options.

    A frozen, hashable value. Build one by hand (``Policy(mode="bf16-mixed")``), read it from a
    config file (``Policy.from_toml``) or get it from ``mpadvise tune``.

    Attributes:
        mode: one of ``MODES`` (a registered mode).
        loss_scale: loss scaling; defaults to dynamic scaling for the modes that scale the
            loss (``fp16-mixed``) and is only allowed there.
        micro_batch_size: the batch one forward pass sees; ``None`` keeps the script's own.
        grad_accum_steps: micro-batches per optimizer step; ``None`` derives it so that the
            script's global batch is kept.
        grad_clip_norm: clip the unscaled gradients to this norm; ``None`` for no clipping.
        fp8: FP8 options; only allowed for the modes that take them (``fp8-te``,
            ``fp8-torchao``).
        reduce_dtype: the dtype FSDP2 reduces gradients in across ranks (``"fp32"``, or a
            16-bit mode's own dtype; see ``reduce_dtype_choices``); ``None`` takes the mode's
            default (``default_reduce_dtype``). Read by
            ``AppliedPolicy.fsdp_mixed_precision()`` only: a single process or DDP ignores it.
        tuned_on: the measurement record, for tuned policies.
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
        """A copy with some fields changed (validated again)."""
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

    # ---- plain data -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML-ready dict with ``schema`` and ``mode`` first; ``None`` fields omitted."""
        return policy_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> Policy:
        """Build and validate a Policy from a dict as written by ``to_dict``.

        Raises:
            PolicyError: naming ``source``, the field and the allowed values.
        """
        values = policy_fields(data, source=source, known={f.name for f in fields(cls)})
        try:
            return cls(**values)
        except (PolicyError, TypeError) as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def to_toml(self, *, framework: str | None = None) -> str:
        """The config file text: readable by a person, ``mode`` at the top level.

        Args:
            framework: the framework a script trains with that never imports advisor
                (``"lightning"``); its header then says to run the script with ``mpadvise run``,
                which applies the policy through the framework, instead of calling
                ``advisor.load_policy()``.
        """
        return config_text(self.to_dict(), framework=framework)

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>") -> Policy:
        """Parse config text. Raises PolicyError naming ``source`` and the problem."""
        return cls.from_dict(parse_config_text(text, source=source), source=source)

    def save(self, path: str | Path, *, framework: str | None = None, force: bool = False) -> Path:
        """Write the config file atomically; ``framework`` as :meth:`to_toml` takes it.

        The file is written under a random name beside ``path`` (created exclusively, never
        through a symlink) and renamed onto it, so a partial file is never left behind and a
        name another user planted is never written through; a symlink at ``path`` itself is
        replaced, not followed. An existing ``path`` is replaced only when it is a config file
        mpadvise can read (a previous tune's, or one written by hand), or with ``force``; a
        training script or any other file is refused.

        Raises:
            MpadviseError: ``path`` holds something other than a config file, or cannot be written.
        """
        path = Path(path)
        if not force:
            _check_replaceable(path)
        try:
            write_file_atomic(path, self.to_toml(framework=framework))
        except OSError as exc:
            raise MpadviseError(f"cannot write config file {path}: {exc.strerror or exc}") from None
        return path


def check_config_target(path: str | Path) -> Path:
    """Refuse now, in one line, a config file path that :meth:`Policy.save` would refuse or
    fail on at the end of a tune: an existing file that is not a config file, a directory, a
    directory that does not exist or cannot be written.

    Refused here, before anything runs, the path is a bad value for where to write (``--out``,
    or the default beside the script that ``--out`` replaces): a usage error. The same refusal
    from :meth:`Policy.save`, at the end of a tune, stays an error of that run.

    Raises:
        UsageError: (exit 2) the reason, naming the path.
    """
    path = Path(path)
    try:
        _check_replaceable(path)
        return check_writable(path, "config file")
    except MpadviseError as exc:
        raise UsageError(str(exc)) from None


def _check_replaceable(path: Path) -> None:
    """Refuse to replace an existing file that is not an mpadvise config file."""
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
    """Read and validate a config file.

    The file must be a regular file (not a symlink) owned by the user running mpadvise or by
    root, and writable by nobody else: a config file applies a precision and a loss scale to
    the user's training, so one that another user wrote, or could have, is refused. The check
    is made on the open file (``fstat``), so its directory may be shared, such as ``/tmp``.

    Raises:
        PolicyError: the file is missing, refused as above, unreadable, not TOML, or holds a
            bad value; the message names the file and the problem on one line.
    """
    path = Path(path)
    try:
        text = read_trusted_text(path, what="config file")
    except IsADirectoryError:
        raise PolicyError(f"config file {path} is a directory, expected a .toml file") from None
    except PolicyError:
        raise
    except MpadviseError as exc:
        raise PolicyError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise PolicyError(f"cannot read config file {path}: {reason}") from None
    return Policy.from_toml(text, source=str(path))
