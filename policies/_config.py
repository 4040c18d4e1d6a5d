"""The Policy (how to train: frozen, validated), its dict and TOML forms and its config file."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from probes import MpadviseError, UsageError, check_writable, read_trusted_text, write_file_atomic

from ._policy_parts import (
    SCHEMA,
    Fp8Options,
    LossScale,
    PolicyError,
    TunedOn,
    check_choice,
    check_policy,
)
from ._registry import mode_class, mode_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The Policy's fields that are sub-tables in its dict and TOML forms.
TABLES: dict[str, type] = {"loss_scale": LossScale, "fp8": Fp8Options, "tuned_on": TunedOn}


@dataclass(frozen=True)
class Policy:
    """How to train: precision mode, loss scaling, batch split and FP8 options; frozen, hashable.

    ``loss_scale`` defaults to dynamic scaling for the modes that scale the loss, and is allowed
    only there; ``micro_batch_size``/``grad_accum_steps`` ``None`` keep the script's global batch;
    ``reduce_dtype`` ``None`` is ``default_reduce_dtype`` (for ``fsdp_mixed_precision()`` only)."""

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

    def with_(self, **changes: Any) -> Policy:
        return replace(self, **changes)

    def describe(self) -> str:
        """One short line for people: ``fp16-mixed (dynamic loss scale 65536), micro-batch 32 x 2``."""
        parts = [self.mode]
        if self.loss_scale is not None and self.loss_scale.kind != "none":
            parts.append(f"({self.loss_scale.kind} loss scale {self.loss_scale.init_scale:g})")
        if self.fp8 is not None and self.fp8.recipe:
            parts.append(f"(recipe {self.fp8.recipe})")
        if self.reduce_dtype is not None:
            parts.append(f"(reduce in {self.reduce_dtype})")
        if self.micro_batch_size is not None:
            accum = f" x {self.grad_accum_steps}" if self.grad_accum_steps else ""
            parts.append(f"micro-batch {self.micro_batch_size}{accum}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """``schema``, then the fields that are set, the sub-tables last (as TOML wants them)."""
        out: dict[str, Any] = {"schema": SCHEMA}
        for name in sorted((f.name for f in fields(self)), key=lambda name: name in TABLES):
            value = getattr(self, name)
            if value is not None:
                out[name] = {f.name: getattr(value, f.name) for f in fields(value)
                             if getattr(value, f.name) is not None} if name in TABLES else value
        if self.tuned_on is not None:
            out["tuned_on"]["libraries"] = {k: v or "" for k, v in self.tuned_on.libraries}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> Policy:
        """Inverse of ``to_dict``; a PolicyError names ``source``, the field and what is allowed."""
        try:
            return cls(**_policy_fields(data, known=[f.name for f in fields(cls)]))
        except (PolicyError, TypeError) as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def to_toml(self, *, framework: str | None = None) -> str:
        """The config file text, after a header that says how to apply it; with ``framework`` (a
        script that never imports advisor), to run the script with ``mpadvise run``."""
        import tomli_w

        if framework is None:
            how = "# mpadvise precision policy. Apply it in a training script with:\n#     mp = advisor.load_policy()\n"
        elif framework.replace("-", "").replace("_", "").isalnum():  # it goes into a comment line
            how = (f"# mpadvise precision policy for a {framework} script, which needs no changed line. Apply it by "
                   "running the script with:\n#     mpadvise run SCRIPT -- ARGS\n")
        else:
            raise ValueError(f"framework {framework!r}: expected a name such as lightning")
        fields_help = "# Fields: see README.md, section 'The config file'\n"
        return how + fields_help + tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>") -> Policy:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"{source}: invalid TOML: {exc}") from None
        return cls.from_dict(data, source=source)

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


def _policy_fields(data: Any, *, known: list[str]) -> dict[str, Any]:
    """A Policy's keyword arguments from its dict form, the sub-tables built."""
    if not isinstance(data, dict):
        raise PolicyError(f"expected a table of policy fields, got {type(data).__name__}")
    values = dict(data)
    schema = values.pop("schema", SCHEMA)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise PolicyError(f"schema {schema!r} is not allowed; expected a positive integer")
    if schema > SCHEMA:
        raise PolicyError(f"schema {schema} is newer than this mpadvise understands ({SCHEMA}); "
                          "upgrade mpadvise (pip install -U mpadvise)")
    if "mode" not in values:
        raise PolicyError(f"missing 'mode'; expected one of {', '.join(mode_names())}")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise PolicyError(f"unknown field {unknown[0]!r}; expected one of schema, "
                          f"{', '.join(sorted(known))}")
    for name, table_cls in TABLES.items():
        if name not in values:
            continue
        table = values[name]
        if not isinstance(table, dict):
            raise PolicyError(f"[{name}] must be a table, got {type(table).__name__} {table!r}")
        allowed = {f.name for f in fields(table_cls)}
        extra = sorted(set(table) - allowed)
        if extra:
            raise PolicyError(f"[{name}] has unknown field {extra[0]!r}; expected one of "
                              f"{', '.join(sorted(allowed))}")
        values[name] = table_cls(**table)
    return values


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
    except (OSError, UnicodeDecodeError, MpadviseError):
        raise MpadviseError(
            f"refusing to replace {path} with a config file: it exists and is not an mpadvise config file; "
            "name a new .toml file (the default is <script>.mpadvise.toml beside the script)"
        ) from None


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
