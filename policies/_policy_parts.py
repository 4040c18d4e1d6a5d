"""What a Policy is made of: its error, its schema number, its sub-tables (``[loss_scale]``,
``[fp8]``, ``[tuned_on]``) and the checks of each field. Messages name a field by its key in the
config file (``loss_scale.kind``), never by the class that holds it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from probes import MpadviseError

from ._registry import fp8_recipes, mode_class, mode_classes, reduce_dtype_choices

if TYPE_CHECKING:
    from ._config import Policy

SCHEMA = 1  # the config file schema this version writes

LOSS_SCALE_KINDS = ("none", "static", "dynamic")
FP8_FORMATS = ("hybrid", "e4m3")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


class PolicyError(MpadviseError, ValueError):
    """A Policy field or a config file holds a value that is not allowed."""


def names_text(names: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    if len(names) < 2:
        return names[0] if names else "no mode"
    return f"{', '.join(names[:-1])} and {names[-1]}"


def refuse(key: str, value: Any, expected: str) -> NoReturn:
    raise PolicyError(f"{key}: {value!r} is not allowed; expected {expected}")


def check_choice(key: str, value: Any, allowed: tuple[str, ...], *, of: str = "") -> None:
    if value not in allowed:
        refuse(key, value, f"one of {', '.join(allowed)}" + (f" ({of})" if of else ""))


def check_positive(key: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0:
        refuse(key, value, "a positive integer" if integer else "a positive number")


@dataclass(frozen=True)
class LossScale:
    """Loss scaling: GradScaler's settings (``"dynamic"``), or a fixed ``init_scale``
    (``"static"``; overflowing steps are still skipped)."""

    kind: str = "dynamic"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        check_choice("loss_scale.kind", self.kind, LOSS_SCALE_KINDS)
        check_positive("loss_scale.init_scale", self.init_scale)
        check_positive("loss_scale.growth_factor", self.growth_factor)
        if self.growth_factor <= 1.0:
            refuse("loss_scale.growth_factor", self.growth_factor, "a number > 1")
        if not isinstance(self.backoff_factor, (int, float)) or not 0.0 < self.backoff_factor < 1.0:
            refuse("loss_scale.backoff_factor", self.backoff_factor, "a number in (0, 1)")
        check_positive("loss_scale.growth_interval", self.growth_interval, integer=True)


@dataclass(frozen=True)
class Fp8Options:
    """FP8 options: ``recipe`` (``None``: the mode's default); ``fp8_format`` ``hybrid`` (E4M3
    forward, E5M2 gradients) or ``e4m3``, and the amax history and margin of Transformer
    Engine's delayed scaling."""

    recipe: str | None = None
    fp8_format: str = "hybrid"
    amax_history_len: int = 1024
    margin: int = 0

    def __post_init__(self) -> None:
        if self.recipe is not None:
            check_choice("fp8.recipe", self.recipe, fp8_recipes())
        check_choice("fp8.fp8_format", self.fp8_format, FP8_FORMATS)
        check_positive("fp8.amax_history_len", self.amax_history_len, integer=True)
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            refuse("fp8.margin", self.margin, "an integer >= 0")


@dataclass(frozen=True)
class TunedOn:
    """Where and when a policy was measured: the evidence that travels with it.

    ``speedup_vs_fp32`` is the tune's one figure (the paired re-measurement when there was one),
    ``speedup_low``/``speedup_high`` its interval, ``speedup_threads`` the CPU threads it was
    measured on where busy cores left fewer than torch's own. ``args``: the script's arguments,
    so a tune with others does not replace this answer unasked (``None``: not recorded).
    ``libraries`` may be given as a table (``""`` for absent), as a config file holds it."""

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
        # TOML and JSON give a table and lists; the values stay hashable tuples.
        libraries = self.libraries.items() if isinstance(self.libraries, dict) else self.libraries
        libraries = tuple(sorted((str(name), version or None) for name, version in libraries))
        object.__setattr__(self, "libraries", libraries)
        args = self.args
        if args is not None:
            if not isinstance(args, (list, tuple)) or not all(isinstance(arg, str) for arg in args):
                refuse("tuned_on.args", args, "a list of strings")
            object.__setattr__(self, "args", tuple(args))
        for name in ("global_batch", "speedup_threads"):
            check_positive(f"tuned_on.{name}", getattr(self, name), integer=True, allow_none=True)
        for name in ("speedup_low", "speedup_high"):
            check_positive(f"tuned_on.{name}", getattr(self, name), allow_none=True)
        if self.speedup_basis is not None and not isinstance(self.speedup_basis, str):
            refuse("tuned_on.speedup_basis", self.speedup_basis, "a string")


def check_policy(policy: Policy) -> None:
    """Check a policy's fields against each other and against its (known) mode."""
    mode = mode_class(policy.mode)
    for key, kind, what in (("loss_scale", LossScale, "a LossScale"),
                            ("fp8", Fp8Options, "Fp8Options")):
        value = getattr(policy, key)
        if value is not None and not isinstance(value, kind):
            raise PolicyError(f"{key}: expected {what}, got {type(value).__name__}")
    if policy.loss_scale is not None and not mode.loss_scaling and policy.loss_scale.kind != "none":
        scaled = names_text([m.name for m in mode_classes() if m.loss_scaling])
        raise PolicyError(f"loss_scale: loss scaling applies to {scaled} only, not "
                          f"{policy.mode!r}; remove [loss_scale] or set kind = \"none\"")
    if policy.fp8 is not None and not mode.fp8_recipes:
        fp8_modes = names_text([m.name for m in mode_classes() if m.fp8_recipes])
        raise PolicyError(f"fp8: FP8 options apply to {fp8_modes} only, not {policy.mode!r}; "
                          "remove [fp8]")
    if policy.fp8 is not None and policy.fp8.recipe is not None:
        check_choice("fp8.recipe", policy.fp8.recipe, mode.fp8_recipes, of=f"the recipes of {policy.mode}")
    check_positive("micro_batch_size", policy.micro_batch_size, integer=True, allow_none=True)
    check_positive("grad_accum_steps", policy.grad_accum_steps, integer=True, allow_none=True)
    check_positive("grad_clip_norm", policy.grad_clip_norm, allow_none=True)
    if policy.reduce_dtype is not None:
        check_choice("reduce_dtype", policy.reduce_dtype, REDUCE_DTYPES)
        allowed = reduce_dtype_choices(policy.mode)
        if policy.reduce_dtype not in allowed:
            raise PolicyError(f"reduce_dtype: {policy.reduce_dtype!r} does not apply to "
                              f"{policy.mode!r}; expected {' or '.join(allowed)} (a mode's "
                              "gradients are reduced in fp32 or in its own 16-bit dtype)")
