"""The Policy: a frozen, validated description of how to train, and its TOML config file."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from probes import MpadviseError, UsageError, check_writable, read_trusted_text, write_file_atomic

from ._registry import fp8_recipes, mode_class, mode_classes, mode_names
from ._true import TrueHalfMode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA = 1
"""Config file schema written by this version. Older schemas are read and upgraded."""

LOSS_SCALE_KINDS = ("none", "static", "dynamic")
FP8_FORMATS = ("hybrid", "e4m3")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
"""The dtypes in which FSDP2 may reduce gradients across ranks (``Policy.reduce_dtype``)."""


class PolicyError(MpadviseError, ValueError):
    """A Policy field or a config file holds a value that is not allowed."""


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(values)


def _names(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    if len(names) < 2:
        return names[0] if names else "no mode"
    return f"{', '.join(names[:-1])} and {names[-1]}"


def reduce_dtype_choices(mode: str) -> tuple[str, ...]:
    """The dtypes a mode's gradients may be reduced in across ranks under FSDP2.

    fp32 for every mode; a 16-bit mode (``dtype_family`` bf16 or fp16) may also reduce in its
    own dtype, which halves the bytes of the reduce-scatter. Reducing fp32 or FP8 training in
    a 16-bit dtype would add a rounding the mode itself never makes, so it is not offered.
    """
    family = mode_class(mode).dtype_family
    return ("fp32", family) if family in ("bf16", "fp16") else ("fp32",)


def default_reduce_dtype(mode: str) -> str:
    """The dtype FSDP2 reduces a mode's gradients in when the policy does not say.

    fp32, as DDP does for a mode that keeps fp32 weights; a "-true" mode's own 16-bit dtype,
    since its gradients are in that dtype and FSDP2 reduces in the parameter dtype by default.
    """
    cls = mode_class(mode)
    return cls.dtype_family if issubclass(cls, TrueHalfMode) else "fp32"


# Messages name a field by its key in the config file, as the user wrote it (``mode``,
# ``loss_scale.kind``), never by the class that holds it.


def _check_choice(key: str, value: Any, allowed: tuple[str, ...], *, of: str = "") -> None:
    if value not in allowed:
        whose = f" ({of})" if of else ""
        raise PolicyError(f"{key}: {value!r} is not allowed; expected one of {_choices(allowed)}{whose}")


def _check_positive(key: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise PolicyError(f"{key}: {value!r} is not allowed; expected {what}")


@dataclass(frozen=True)
class LossScale:
    """Loss scaling for fp16-mixed: the GradScaler settings, or a static scale.

    Attributes:
        kind: ``"dynamic"`` (GradScaler), ``"static"`` (a fixed scale; overflowing steps are
            still skipped) or ``"none"``.
        init_scale: starting scale (dynamic) or the fixed scale (static). GradScaler's default
            is 2**16.
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps.
        backoff_factor: multiply the scale by this after an overflow.
        growth_interval: clean steps between growths.
    """

    kind: str = "dynamic"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        _check_choice("loss_scale.kind", self.kind, LOSS_SCALE_KINDS)
        _check_positive("loss_scale.init_scale", self.init_scale)
        _check_positive("loss_scale.growth_factor", self.growth_factor)
        if self.growth_factor <= 1.0:
            raise PolicyError(f"loss_scale.growth_factor: {self.growth_factor!r} is not allowed; expected a number > 1")
        if not isinstance(self.backoff_factor, (int, float)) or not 0.0 < self.backoff_factor < 1.0:
            raise PolicyError(
                f"loss_scale.backoff_factor: {self.backoff_factor!r} is not allowed; expected a number in (0, 1)"
            )
        _check_positive("loss_scale.growth_interval", self.growth_interval, integer=True)


@dataclass(frozen=True)
class Fp8Options:
    """FP8 recipe options, for ``fp8-torchao`` and ``fp8-te``.

    Attributes:
        recipe: one of the FP8 mode's ``fp8_recipes``. torchao: ``tensorwise`` (default),
            ``rowwise``, ``rowwise_with_gw_hp``; Transformer Engine: ``delayed`` (default),
            ``current``, ``mxfp8``, ``block``. ``None`` takes the backend's default.
        fp8_format: ``hybrid`` (E4M3 forward, E5M2 gradients) or ``e4m3`` (Transformer Engine).
        amax_history_len: amax history for Transformer Engine's delayed scaling.
        margin: scaling margin (powers of two) for Transformer Engine's delayed scaling.
    """

    recipe: str | None = None
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    margin: int = 0

    def __post_init__(self) -> None:
        if self.recipe is not None:
            _check_choice("fp8.recipe", self.recipe, fp8_recipes())
        _check_choice("fp8.fp8_format", self.fp8_format, FP8_FORMATS)
        _check_positive("fp8.amax_history_len", self.amax_history_len, integer=True)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise PolicyError(f"fp8.margin: {self.margin!r} is not allowed; expected an integer >= 0")


@dataclass(frozen=True)
class TunedOn:
    """Where and when a policy was measured: the evidence that travels with it.

    Attributes:
        hardware_fingerprint: ``probes.hardware_fingerprint`` of the device it was tuned on.
        device: the device's name, for people.
        torch: torch version at tuning time.
        libraries: FP8 library versions at tuning time (``(name, version or None)`` pairs).
        date: ISO date of the tune.
        speedup_vs_fp32: measured goodput ratio of this policy over fp32: the tune's one
            figure (the paired re-measurement against fp32 when there was one).
        goodput: measured samples per second.
        workload_fingerprint: fingerprint of model, optimizer, global batch and script.
        model_signature: fingerprint of the model's structure alone.
        script: the script that was tuned.
        trials: number of trials run.
        cuda: CUDA runtime at tuning time (empty on a CPU).
        global_batch: the script's global batch at tuning time (samples per optimizer step);
            at run time a different script batch keeps the script's own global batch.
        script_digest: digest of the script's content at tuning time, so that a run can say
            "script edited" rather than only "workload changed".
        speedup_low: the lower end of the speed-up's confidence interval, when it has one.
        speedup_high: the upper end.
        speedup_basis: what the speed-up rests on, in words ("paired re-measurement, 4 pairs",
            "single runs, not re-measured").
        speedup_threads: the CPU threads the speed-up was measured on, where other processes
            kept cores busy and its runs had fewer than torch's own; ``None``: torch's own (or a
            GPU). A gain measured on fewer threads can differ from the gain on all cores.
        args: the script's command-line arguments the tune ran it with (``()`` for none), so
            that a tune with other arguments does not replace this answer unasked and a run
            with others can say so; ``None`` in a config written before they were recorded.
    """

    hardware_fingerprint: str = ""
    device: str = ""
    torch: str = ""
    libraries: tuple[tuple[str, str | None], ...] = ()
    date: str = ""
    speedup_vs_fp32: float | None = None
    goodput: float | None = None
    workload_fingerprint: str | None = None
    model_signature: str | None = None
    script: str | None = None
    trials: int | None = None
    cuda: str = ""
    global_batch: int | None = None
    script_digest: str | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    speedup_basis: str | None = None
    args: tuple[str, ...] | None = None
    speedup_threads: int | None = None

    def __post_init__(self) -> None:
        _check_positive("tuned_on.global_batch", self.global_batch, integer=True, allow_none=True)
        if self.args is not None:
            # TOML and JSON give a list; the value stays a hashable tuple of strings.
            if isinstance(self.args, str) or not isinstance(self.args, (list, tuple)) or not all(
                isinstance(arg, str) for arg in self.args
            ):
                raise PolicyError(f"tuned_on.args: {self.args!r} is not allowed; expected a list of strings")
            object.__setattr__(self, "args", tuple(self.args))
        _check_positive("tuned_on.speedup_threads", self.speedup_threads, integer=True, allow_none=True)
        for name in ("speedup_low", "speedup_high"):
            _check_positive(f"tuned_on.{name}", getattr(self, name), allow_none=True)
        if self.speedup_basis is not None and not isinstance(self.speedup_basis, str):
            raise PolicyError(f"tuned_on.speedup_basis: {self.speedup_basis!r} is not allowed; expected a string")


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
        _check_choice("mode", self.mode, mode_names())
        mode = mode_class(self.mode)
        if mode.loss_scaling and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())
        if self.loss_scale is not None:
            if not isinstance(self.loss_scale, LossScale):
                raise PolicyError(f"loss_scale: expected a LossScale, got {type(self.loss_scale).__name__}")
            if not mode.loss_scaling and self.loss_scale.kind != "none":
                scaled = _names([m.name for m in mode_classes() if m.loss_scaling])
                raise PolicyError(
                    f"loss_scale: loss scaling applies to {scaled} only, not {self.mode!r}; "
                    "remove [loss_scale] or set kind = \"none\""
                )
        if self.fp8 is not None:
            if not isinstance(self.fp8, Fp8Options):
                raise PolicyError(f"fp8: expected Fp8Options, got {type(self.fp8).__name__}")
            if not mode.fp8_recipes:
                fp8_modes = _names([m.name for m in mode_classes() if m.fp8_recipes])
                raise PolicyError(
                    f"fp8: FP8 options apply to {fp8_modes} only, not {self.mode!r}; remove [fp8]"
                )
            if self.fp8.recipe is not None:
                _check_choice("fp8.recipe", self.fp8.recipe, mode.fp8_recipes, of=f"the recipes of {self.mode}")
        _check_positive("micro_batch_size", self.micro_batch_size, integer=True, allow_none=True)
        _check_positive("grad_accum_steps", self.grad_accum_steps, integer=True, allow_none=True)
        _check_positive("grad_clip_norm", self.grad_clip_norm, allow_none=True)
        if self.reduce_dtype is not None:
            _check_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
            allowed = reduce_dtype_choices(self.mode)
            if self.reduce_dtype not in allowed:
                raise PolicyError(
                    f"reduce_dtype: {self.reduce_dtype!r} does not apply to {self.mode!r}; expected "
                    f"{' or '.join(allowed)} (a mode's gradients are reduced in fp32 or in its own 16-bit dtype)"
                )

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
        out: dict[str, Any] = {"schema": SCHEMA, "mode": self.mode}
        for name in ("micro_batch_size", "grad_accum_steps", "grad_clip_norm", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.loss_scale is not None:
            out["loss_scale"] = _table(self.loss_scale)
        if self.fp8 is not None:
            out["fp8"] = _table(self.fp8)
        if self.tuned_on is not None:
            tuned = _table(self.tuned_on)
            tuned["libraries"] = {k: (v if v is not None else "") for k, v in self.tuned_on.libraries}
            out["tuned_on"] = tuned
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "policy") -> Policy:
        """Build and validate a Policy from a dict as written by ``to_dict``.

        Raises:
            PolicyError: naming ``source``, the field and the allowed values.
        """
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a table of policy fields, got {type(data).__name__}")
        data = dict(data)
        schema = data.pop("schema", SCHEMA)
        if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
            raise PolicyError(f"{source}: schema {schema!r} is not allowed; expected a positive integer")
        if schema > SCHEMA:
            raise PolicyError(
                f"{source}: schema {schema} is newer than this mpadvise understands ({SCHEMA}); "
                "upgrade mpadvise (pip install -U mpadvise)"
            )
        if "mode" not in data:
            raise PolicyError(f"{source}: missing 'mode'; expected one of {_choices(mode_names())}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"{source}: unknown field {unknown[0]!r}; expected one of schema, {', '.join(sorted(known))}")
        try:
            if "loss_scale" in data:
                data["loss_scale"] = _from_table(LossScale, data["loss_scale"], "loss_scale")
            if "fp8" in data:
                data["fp8"] = _from_table(Fp8Options, data["fp8"], "fp8")
            if "tuned_on" in data:
                tuned = dict(_require_table(data["tuned_on"], "tuned_on"))
                libs = tuned.get("libraries", {})
                if isinstance(libs, dict):
                    tuned["libraries"] = tuple(sorted((str(k), v or None) for k, v in libs.items()))
                else:
                    tuned["libraries"] = tuple(tuple(x) for x in libs)
                data["tuned_on"] = _from_table(TunedOn, tuned, "tuned_on")
            return cls(**data)
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None
        except TypeError as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def to_toml(self, *, framework: str | None = None) -> str:
        """The config file text: readable by a person, ``mode`` at the top level.

        Args:
            framework: the framework a script trains with that never imports advisor
                (``"lightning"``); its header then says to run the script with ``mpadvise run``,
                which applies the policy through the framework, instead of calling
                ``advisor.load_policy()``.
        """
        import tomli_w

        if framework is None:
            how = "# mpadvise precision policy. Apply it in a training script with:\n#     mp = advisor.load_policy()\n"
        else:
            if not framework.replace("-", "").replace("_", "").isalnum():  # it goes into a comment line
                raise ValueError(f"framework {framework!r}: expected a name such as lightning")
            how = (f"# mpadvise precision policy for a {framework} script, which needs no changed line. Apply it by "
                   "running the script with:\n#     mpadvise run SCRIPT -- ARGS\n")
        return how + "# Fields: see README.md, section 'The config file'\n" + tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<string>") -> Policy:
        """Parse config text. Raises PolicyError naming ``source`` and the problem."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"{source}: invalid TOML: {exc}") from None
        return cls.from_dict(data, source=source)

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


def _table(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None}


def _require_table(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PolicyError(f"[{name}] must be a table, got {type(value).__name__} {value!r}")
    return value


def _from_table(cls: type, value: Any, name: str) -> Any:
    table = _require_table(value, name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise PolicyError(f"[{name}] has unknown field {unknown[0]!r}; expected one of {', '.join(sorted(known))}")
    return cls(**table)
