"""The search space and the pure decisions of the tuner: candidates, priors, bounds, ranking."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from advisor.tune._stability import safety_rank
from policies import (
    LossScale,
    Policy,
    default_reduce_dtype,
    mode_classes,
    mode_dtypes,
    reduce_dtype_choices,
)

# The loss scales tried for a mode that scales its loss (PrecisionMode.loss_scaling).
FP16_INIT_SCALES: tuple[float, ...] = (2.0**8, 2.0**12, 2.0**16)
FP16_GROWTH_INTERVALS: tuple[int, ...] = (500, 2000)
# A candidate whose matmul dtype runs at under this fraction of fp32's rate on this device
# cannot beat fp32 (at best it ties, and ties go to the safer policy): it is not worth a trial.
SLOW_DTYPE_RATIO = 0.5
# How far a candidate of an unmeasured mode may beat what its matmul ratio alone predicts
# (memory-bound work halves its bytes in 16-bit dtypes; kernels differ).
PRIOR_SLACK = 1.25
# The instabilities a micro-batch split of the same settings cannot cure: the same update is lost to
# rounding alike (stalled), and smaller per-micro-batch gradients only underflow more.
SPLIT_KEEPS: frozenset[str] = frozenset({"stalled", "underflow"})
# The Optuna values of the FSDP2 gradient reduction dimension, one list for every mode (a
# categorical parameter keeps its choices for the whole study).
REDUCE_CHOICES: tuple[str, ...] = ("fp32", "16-bit")


@dataclass(frozen=True, order=True)
class Candidate:
    """A precision mode and its settings (``reduce_dtype``: FSDP2's gradient reduction)."""

    mode: str
    micro_batch: int | None = None
    loss_scale: str | None = None
    init_scale: float | None = None
    growth_interval: int | None = None
    reduce_dtype: str | None = None

    def policy(self, user_batch: int | None) -> Policy:
        """The Policy a trial runs: accumulation keeps the global batch when the micro-batch divides it."""
        loss_scale = None
        if scales_loss(self.mode):
            loss_scale = LossScale(kind=self.loss_scale or "dynamic", init_scale=self.init_scale or 65536.0,
                                   growth_interval=self.growth_interval or 2000)
        micro = accum = None
        if self.micro_batch is not None and self.micro_batch != user_batch:
            micro = self.micro_batch
            accum = max(1, user_batch // self.micro_batch) if user_batch and self.micro_batch < user_batch else 1
        return Policy(mode=self.mode, loss_scale=loss_scale, micro_batch_size=micro, grad_accum_steps=accum,
                      reduce_dtype=self.reduce_dtype)

    @property
    def label(self) -> str:
        parts = [self.mode]
        if scales_loss(self.mode) and self.loss_scale:
            parts.append(f"{self.loss_scale} 2^{int(math.log2(self.init_scale or 65536))}")
            if self.loss_scale == "dynamic" and self.growth_interval:
                parts.append(f"g{self.growth_interval}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce-{self.reduce_dtype}")
        if self.micro_batch is not None:
            parts.append(f"mb{self.micro_batch}")
        return " ".join(parts)

    def params(self) -> dict[str, object]:
        out: dict[str, object] = {"mode": self.mode}
        if self.micro_batch is not None:
            out["micro_batch"] = self.micro_batch
        if scales_loss(self.mode):
            out["loss_scale"] = self.loss_scale or "dynamic"
            out["init_scale"] = self.init_scale or 65536.0
            if (self.loss_scale or "dynamic") == "dynamic":
                out["growth_interval"] = self.growth_interval or 2000
        if self.reduce_dtype is not None:
            out["reduce_dtype"] = REDUCE_CHOICES[0] if self.reduce_dtype == "fp32" else REDUCE_CHOICES[1]
        return out


@dataclass(frozen=True)
class SpaceLimits:
    """What the script's way of training can apply (all for the loop API; what its framework
    expresses for a framework script, ``why`` naming it), which bounds the search space."""

    modes: tuple[str, ...] | None = None
    micro_batch: bool = True
    loss_scale_kinds: tuple[str, ...] = ("static", "dynamic")
    loss_scale_settings: bool = True
    why: str = ""

    def allows(self, candidate: Candidate) -> bool:
        if self.modes is not None and candidate.mode not in self.modes:
            return False
        if candidate.micro_batch is not None and not self.micro_batch:
            return False
        if not scales_loss(candidate.mode):
            return True
        settings = (candidate.init_scale or 65536.0, candidate.growth_interval or 2000)
        return (candidate.loss_scale or "dynamic") in self.loss_scale_kinds and (
            self.loss_scale_settings or settings == (65536.0, 2000))


@dataclass(frozen=True)
class SearchSpace:
    """The candidates a tune may try. ``fsdp``: the script shards with FSDP2, so the gradient
    reduction dtype is a dimension of the 16-bit modes."""

    modes: tuple[str, ...]
    micro_batches: tuple[int, ...]
    user_batch: int | None
    scale_batch: bool = False
    limits: SpaceLimits = SpaceLimits()
    fsdp: bool = False

    def reduce_options(self, mode: str) -> list[str]:  # empty where it is no dimension
        return list(REDUCE_CHOICES) if self.fsdp and len(reduce_dtype_choices(mode)) > 1 else []

    def reduce_dtype(self, mode: str, value: str) -> str:
        return "fp32" if value == REDUCE_CHOICES[0] else reduce_dtype_choices(mode)[-1]

    def normalise(self, candidate: Candidate) -> Candidate:
        """Drop settings that do not apply, so that equal policies compare equal."""
        micro = candidate.micro_batch
        if micro == self.user_batch:
            micro = None  # the script's own batch
        # Under FSDP2 the reduction dtype is always named.
        reduce = (candidate.reduce_dtype or default_reduce_dtype(candidate.mode)
                  if self.reduce_options(candidate.mode) else None)
        if not scales_loss(candidate.mode):
            return Candidate(candidate.mode, micro, reduce_dtype=reduce)
        kind = candidate.loss_scale or "dynamic"
        return Candidate(
            candidate.mode, micro, kind, candidate.init_scale or 65536.0,
            (candidate.growth_interval or 2000) if kind == "dynamic" else None, reduce,
        )

    def grid(self) -> list[Candidate]:
        out = []
        for mode in self.modes:
            reduces = [self.reduce_dtype(mode, v) for v in self.reduce_options(mode)] or [None]
            # A script whose batch is unknown (no micro_batch_size() call) keeps its own batch:
            # its modes are still candidates, at that batch.
            for micro in self.micro_batches or (None,):
                for reduce in reduces:
                    if not scales_loss(mode):
                        out.append(self.normalise(Candidate(mode, micro, reduce_dtype=reduce)))
                        continue
                    for scale in FP16_INIT_SCALES:
                        out.append(self.normalise(Candidate(mode, micro, "static", scale, reduce_dtype=reduce)))
                        for growth in FP16_GROWTH_INTERVALS:
                            out.append(self.normalise(Candidate(mode, micro, "dynamic", scale, growth, reduce)))
        return [c for c in dict.fromkeys(out) if self.limits.allows(c)]


def scales_loss(mode: str) -> bool:
    return any(cls.name == mode and cls.loss_scaling for cls in mode_classes())


def micro_batch_choices(user_batch: int | None, *, scale_batch: bool = False) -> tuple[int, ...]:
    """The user's batch, its halves and quarters, and with ``scale_batch`` double and quadruple."""
    if not user_batch:
        return ()
    choices = [user_batch, *(user_batch // div for div in (2, 4) if user_batch % div == 0)]
    if scale_batch:
        choices += [user_batch * 2, user_batch * 4]
    return tuple(dict.fromkeys(choices))


def space_for(
    support: Mapping[str, object], user_batch: int | None, *, include_emulated: bool = False,
    scale_batch: bool = False, modes: Iterable[str] | None = None, limits: SpaceLimits | None = None,
    fsdp: bool = False,
) -> SearchSpace:
    """The space on this hardware: the modes ``support`` (``policies.supported_modes``) supports;
    FP8 emulated on a CPU only with ``include_emulated``."""
    limits = limits or SpaceLimits()
    dtypes = mode_dtypes()
    chosen = [
        mode for mode in (list(modes) if modes else list(support))
        if support[mode].supported  # type: ignore[attr-defined]
        # FP8 emulated (on a CPU) has FP8's numerics but none of its speed.
        and not (dtypes.get(mode) == "fp8" and support[mode].emulated  # type: ignore[attr-defined]
                 and not include_emulated)
        and (limits.modes is None or mode in limits.modes)
    ]
    if "fp32" not in chosen:
        chosen.insert(0, "fp32")
    micro = micro_batch_choices(user_batch, scale_batch=scale_batch)
    if not limits.micro_batch:
        micro = (user_batch,) if user_batch else ()
    return SearchSpace(tuple(chosen), micro, user_batch, scale_batch, limits, fsdp)


@dataclass(frozen=True)
class Measured:
    """What the search knows about one evaluated candidate."""

    candidate: Candidate
    goodput: float  # samples/s; 0 when it did not run
    feasible: bool  # ran and fit in memory
    stable: bool
    oom: bool = False
    outcome: str = ""  # ok / unstable / oom / crash / ... for reports
    reason: str = ""
    verdict_kind: str = ""  # the stability verdict's kind (diverged, stalled, ...); "" when not judged


def upper_bound(
    candidate: Candidate, measured: Mapping[Candidate, Measured], *, user_batch: int | None, reference_goodput: float,
    dtype_ratio: Mapping[str, float],
) -> float:
    """The most goodput this untried candidate could plausibly reach (0 when it cannot run): a
    split of settings unstable in a way no split cures stays unstable; a micro-batch at or above
    one that ran out of memory cannot fit; a variant is no faster than a stable run of its mode at
    a batch at least as large; else the dtype's matmul ratio to fp32 bounds it."""
    size = candidate.micro_batch or user_batch or 0
    same_mode = [m for m in measured.values() if m.candidate.mode == candidate.mode]
    for m in same_mode:
        # Another loss scale might cure any instability, and is still explored.
        if (m.feasible and not m.stable and m.verdict_kind in SPLIT_KEEPS
                and dataclasses.replace(m.candidate, micro_batch=None) == dataclasses.replace(candidate, micro_batch=None)
                or m.oom and size >= (m.candidate.micro_batch or user_batch or 0)):
            return 0.0
    # Only stable runs bound a variant: an unstable run's goodput is lowered by the steps it
    # skipped, which another loss scale may not skip, so it says nothing of the variant's speed.
    # A run that reduced its gradients in more bytes than the candidate does bounds nothing either.
    runs = [m.goodput for m in same_mode
            if m.stable and m.feasible and (m.candidate.micro_batch or user_batch or 0) >= size
            and (candidate.reduce_dtype in (None, "fp32") or m.candidate.reduce_dtype == candidate.reduce_dtype)]
    if runs:
        # Another loss scale, or a smaller micro-batch accumulated back, does not make a step
        # faster than a measured run of the same mode at a batch at least as large.
        return max(runs)
    ratio = dtype_ratio.get(mode_dtypes().get(candidate.mode, ""))
    if ratio is None:
        return math.inf
    if ratio < SLOW_DTYPE_RATIO and candidate.mode != "fp32":
        return reference_goodput
    return reference_goodput * max(ratio, 1.0) * PRIOR_SLACK


def preference_key(candidate: Candidate, user_batch: int | None) -> tuple[int, int, int, int]:
    """Sort key among ties: safer mode, fewer accumulation steps, dynamic loss scaling, fp32 reduction."""
    accum = 1
    if candidate.micro_batch and user_batch and candidate.micro_batch < user_batch:
        accum = user_batch // candidate.micro_batch
    return (safety_rank(candidate.mode), accum, 0 if candidate.loss_scale in (None, "dynamic") else 1,
            0 if candidate.reduce_dtype in (None, "fp32") else 1)
