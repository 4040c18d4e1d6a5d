"""What a framework can apply of a Policy, as a value that judges a policy by itself (pure):
the search space, the trial child, ``mpadvise run`` and ``mpadvise export`` all read it, so a
policy that wins a tune is one its framework can run, and its export is what the trial applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies import LossScale, Policy, mode_class


@dataclass(frozen=True)
class FrameworkTraits:
    """What a framework can apply without a changed line in the script (``limits``: for people)."""

    name: str
    modes: tuple[str, ...]
    sets_micro_batch: bool
    loss_scale_kinds: tuple[str, ...]
    loss_scale_settings: bool
    fp8_recipes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    sets_grad_clip: bool = True
    needs_cuda: tuple[str, ...] = ()
    limits: tuple[str, ...] = ()

    def refusal(self, policy: Policy, *, device: str | None = None) -> str | None:
        """One line on why this framework cannot apply ``policy``, or ``None`` when it can."""
        t, framework = self, self.name
        if policy.mode not in t.modes:
            return f"{framework} cannot apply mode {policy.mode} (it can apply {', '.join(t.modes)})"
        if device is not None and not device.startswith("cuda") and policy.mode in t.needs_cuda:
            return f"{framework} applies {policy.mode} on CUDA only: on {device} it would silently train in fp32"
        split = policy.micro_batch_size is not None or (policy.grad_accum_steps or 1) > 1
        if split and not t.sets_micro_batch:
            return (f"{framework} cannot change the micro-batch: the script's DataLoader sets it "
                    f"(the policy asks for micro-batch {policy.micro_batch_size} x {policy.grad_accum_steps or 1})")
        if policy.grad_clip_norm is not None and not t.sets_grad_clip:
            return f"{framework} leaves gradient clipping to the script: it cannot apply grad_clip_norm {policy.grad_clip_norm:g}"
        ls = policy.loss_scale
        if ls is not None and mode_class(policy.mode).loss_scaling:
            # "none" included: a framework whose fp16 always builds a GradScaler cannot run without one.
            if ls.kind not in t.loss_scale_kinds:
                if ls.kind == "none":
                    return f"{framework} always scales an fp16 loss with a GradScaler, and the policy has no loss scaling"
                return f"{framework} cannot apply a {ls.kind} loss scale (only {', '.join(t.loss_scale_kinds)})"
            if not t.loss_scale_settings:
                changed = [k for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
                           if getattr(ls, k) != getattr(LossScale(), k)]
                if changed:
                    return (f"{framework} cannot set GradScaler's {', '.join(changed)}: it always uses "
                            "GradScaler's defaults (initial scale 65536, growth interval 2000)")
        recipes = t.fp8_recipes.get(policy.mode)
        if recipes is not None:
            recipe = (policy.fp8.recipe if policy.fp8 is not None else None) or recipes[0]
            if recipe not in recipes:
                return f"{framework} cannot build the {policy.mode} recipe {recipe!r} (only {', '.join(recipes)})"
        return None
