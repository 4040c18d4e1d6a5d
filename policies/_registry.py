"""Which precision modes exist: one ordered registry of mode classes, which everything that
lists modes reads. The mode modules import torch and the FP8 libraries only inside methods."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, TypeVar

from probes import MpadviseError, UsageError

from ._base import WHERE_IT_RUNS, ModeFacts, PrecisionMode
from ._half import TrueHalfMode
from .bf16_mixed import Bf16Mixed
from .bf16_true import Bf16True
from .fp8_te import Fp8Te
from .fp8_torchao import Fp8Torchao
from .fp16_mixed import Fp16Mixed
from .fp16_true import Fp16True
from .fp32 import Fp32
from .tf32 import Tf32

if TYPE_CHECKING:
    import torch

    from ._config import Policy

ModeT = TypeVar("ModeT", bound=type[PrecisionMode])

# The registered classes by name, in registration order: the order of MODES, of the support
# table and of `mpadvise probe`.
_REGISTRY: dict[str, type[PrecisionMode]] = {}


def register_mode(cls: ModeT) -> ModeT:
    """Add a mode class after those registered (a class decorator; again for the same class
    does nothing). A missing or clashing description is a ValueError naming it and the fix."""
    if not (isinstance(cls, type) and issubclass(cls, PrecisionMode)):
        raise TypeError(f"register_mode: {cls!r} is not a PrecisionMode subclass; derive the "
                        "mode's class from policies.PrecisionMode")
    name, recipes = getattr(cls, "name", None), cls.fp8_recipes
    family, rank = getattr(cls, "dtype_family", None), getattr(cls, "safety_rank", None)
    if isinstance(name, str) and _REGISTRY.get(name) is cls:
        return cls
    ranks = f"(ranks in use: {', '.join(f'{c.name} {c.safety_rank}' for c in _by_safety())})"
    rank_owner = next((c.name for c in _REGISTRY.values() if c.safety_rank == rank), None)
    problem = None
    if not isinstance(name, str) or not name:
        problem = f"name {name!r} is not allowed; set name to the mode's name, e.g. 'int8-mixed'"
    elif name in _REGISTRY:
        problem = (f"mode {name!r} is already registered by {_REGISTRY[name].__qualname__}; "
                   "give the class a name of its own")
    elif not isinstance(family, str) or not family:
        problem = (f"dtype_family {family!r} is not allowed; set it to the dtype of most matmuls, "
                   "e.g. 'bf16'")
    elif isinstance(rank, bool) or not isinstance(rank, int):
        problem = f"safety_rank {rank!r} is not allowed; set an integer, lower is safer {ranks}"
    elif rank_owner is not None:
        problem = f"safety_rank {rank} is already {rank_owner}'s; pick an unused rank {ranks}"
    elif not isinstance(recipes, tuple) or not all(isinstance(r, str) for r in recipes):
        problem = f"fp8_recipes {recipes!r} is not allowed; expected a tuple of recipe names"
    elif not _says_where_it_runs(cls):
        problem = f"the class does not say where it runs; {WHERE_IT_RUNS}"
    if problem is not None:
        raise ValueError(f"register_mode({cls.__qualname__}): {problem}")
    _REGISTRY[name] = cls
    return cls


def _says_where_it_runs(cls: type[PrecisionMode]) -> bool:
    def defined(method: str) -> bool:
        return getattr(cls, method).__func__ is not getattr(PrecisionMode, method).__func__

    return defined("support") or (defined("cuda_support") and defined("cpu_support"))


def unregister_mode(name: str) -> None:
    del _REGISTRY[mode_class(name).name]


def mode_classes() -> tuple[type[PrecisionMode], ...]:
    return tuple(_REGISTRY.values())


def mode_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def mode_class(mode: str) -> type[PrecisionMode]:
    try:
        return _REGISTRY[mode]
    except (KeyError, TypeError):
        raise MpadviseError(f"unknown mode {mode!r}; expected one of {', '.join(_REGISTRY)}") from None


# Other tools' names for our modes, as a user types them: Lightning's ``precision=`` strings
# (``16`` and ``bf16`` are its older spellings of the mixed modes) and Transformer Engine's plugin
# name. Each maps to the one mode that does the same arithmetic.
MODE_ALIASES: dict[str, str] = {
    "16-mixed": "fp16-mixed", "16": "fp16-mixed", "fp16": "fp16-mixed", "bf16": "bf16-mixed",
    "16-true": "fp16-true", "32-true": "fp32", "32": "fp32", "transformer-engine": "fp8-te",
}


def canonical_mode(name: str) -> str:
    """The registered mode a user means by ``name``: the name in any case, or an alias; else a
    UsageError suggesting the closest names."""
    text = str(name).strip()
    aliases = {alias: mode for alias, mode in MODE_ALIASES.items() if mode in _REGISTRY}
    by_lower = {**aliases, **{registered.lower(): registered for registered in _REGISTRY}}
    if text.lower() in by_lower:
        return by_lower[text.lower()]
    close = difflib.get_close_matches(text.lower(), [*_REGISTRY, *aliases], n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise UsageError(f"unknown mode {text!r}; {hint}expected one of {', '.join(_REGISTRY)} "
                     "(or Lightning's 16-mixed, bf16-mixed, bf16-true, 32-true, 32, 16, bf16)")


def create_mode(policy: Policy, device: torch.device) -> PrecisionMode:
    return mode_class(policy.mode)(policy, device)


def _by_safety() -> list[type[PrecisionMode]]:
    return sorted(_REGISTRY.values(), key=lambda cls: cls.safety_rank)


def safety_order() -> tuple[str, ...]:
    return tuple(cls.name for cls in _by_safety())


def safety_rank(mode: str) -> int:
    """How safe a registered mode is numerically; lower is safer."""
    cls = _REGISTRY.get(mode) if isinstance(mode, str) else None
    if cls is None:
        raise ValueError(f"mode {mode!r} has no safety rank; expected one of "
                         f"{', '.join(safety_order())} (a new mode is ranked by its class's "
                         "safety_rank once registered with policies.register_mode)")
    return cls.safety_rank


def mode_dtypes() -> dict[str, str]:
    return {cls.name: cls.dtype_family for cls in _REGISTRY.values()}


def mode_facts(mode: str) -> ModeFacts:
    return mode_class(mode).facts()


def reduce_dtype_choices(mode: str) -> tuple[str, ...]:
    """The dtypes FSDP2 may reduce a mode's gradients in: fp32, and a 16-bit mode's own dtype
    (half the bytes); fp32 or FP8 training in 16 bits would add a rounding the mode never makes."""
    family = mode_class(mode).dtype_family
    return ("fp32", family) if family in ("bf16", "fp16") else ("fp32",)


def default_reduce_dtype(mode: str) -> str:
    """fp32, as DDP does for fp32 weights; a "-true" mode's own dtype, its gradients' dtype."""
    cls = mode_class(mode)
    return cls.dtype_family if issubclass(cls, TrueHalfMode) else "fp32"


def fp8_recipes() -> tuple[str, ...]:
    return tuple(dict.fromkeys(recipe for cls in _REGISTRY.values() for recipe in cls.fp8_recipes))


# The modes that ship with mpadvise, in the order they are listed everywhere.
for _cls in (Fp32, Tf32, Fp16Mixed, Bf16Mixed, Fp16True, Bf16True, Fp8Te, Fp8Torchao):
    register_mode(_cls)
