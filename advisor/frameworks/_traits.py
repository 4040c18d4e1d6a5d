"""What a framework can apply of a Policy, as a value that judges a policy by itself (pure).

One value serves three users: the search space of a framework script (only what the framework
can apply is searched), the trial child and ``mpadvise run`` (which refuse a policy the
framework cannot apply), and ``mpadvise export`` (whose exporters receive the traits). Each
adapter class builds its traits from its declarations and the registered modes
(``FrameworkAdapter.traits``), so a policy that wins a tune is always one its framework can
run, and the export of it is what the trial applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies import Policy, mode_class
from probes import UsageError


@dataclass(frozen=True)
class FrameworkTraits:
    """What a framework can apply without a changed line in the script.

    Attributes:
        name: the framework.
        modes: the modes it can apply.
        sets_micro_batch: whether it owns the micro-batch size (so a split with accumulation
            can be applied); otherwise the script's DataLoader decides it.
        loss_scale_kinds: the loss scaling kinds it can apply for fp16-mixed.
        loss_scale_settings: whether the initial scale and growth interval can be set.
        fp8_recipes: per FP8 mode, the recipes it can build.
        sets_grad_clip: whether it can apply the policy's gradient clipping (otherwise the
            script clips, if at all).
        needs_cuda: modes it applies on CUDA only (on a CPU it would silently run another).
        limits: one sentence per thing it cannot express, for people.
    """

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
        """Why this framework cannot apply ``policy`` as it stands, or ``None`` when it can.

        Args:
            policy: the policy to apply.
            device: ``"cpu"`` or ``"cuda..."`` where it would run, for the modes a framework
                applies on CUDA only; ``None`` leaves the device out of the judgement.

        Returns:
            One line naming the part of the policy and what the framework lacks.
        """
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
                changed = [k for k, v in _DEFAULT_LOSS_SCALE.items() if getattr(ls, k) != v]
                if changed:
                    return (f"{framework} cannot set GradScaler's {', '.join(changed)}: it always uses "
                            "GradScaler's defaults (initial scale 65536, growth interval 2000)")
        recipes = t.fp8_recipes.get(policy.mode)
        if recipes is not None:
            recipe = (policy.fp8.recipe if policy.fp8 is not None else None) or recipes[0]
            if recipe not in recipes:
                return f"{framework} cannot build the {policy.mode} recipe {recipe!r} (only {', '.join(recipes)})"
        return None


_DEFAULT_LOSS_SCALE = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}

# ---- transitional ---------------------------------------------------------------------------------
# The export module still reads these tables and `traits`; the registry (`_registry`) derives
# the same from the adapter classes and the modes' facts. They go once the export reads neither.

# Lightning's and Fabric's precision strings for the modes they have.
LIGHTNING_PRECISION: Mapping[str, str] = {
    "fp32": "32-true",
    "tf32": "32-true",  # plus the TF32 matmul switch, which Lightning leaves to torch
    "fp16-mixed": "16-mixed",
    "bf16-mixed": "bf16-mixed",
    "fp16-true": "16-true",
    "bf16-true": "bf16-true",
    "fp8-te": "transformer-engine",  # applied as the plugin with fp32 weights, not the bf16 string
}
# Accelerate's mixed_precision values.
ACCELERATE_PRECISION: Mapping[str, str] = {
    "fp32": "no",
    "tf32": "no",
    "fp16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "fp8-te": "fp8",
    "fp8-torchao": "fp8",
}
# TrainingArguments' precision fields.
TRANSFORMERS_PRECISION: Mapping[str, Mapping[str, bool]] = {
    "fp32": {"fp16": False, "bf16": False, "tf32": False},
    "tf32": {"fp16": False, "bf16": False, "tf32": True},
    "fp16-mixed": {"fp16": True, "bf16": False, "tf32": False},
    "bf16-mixed": {"fp16": False, "bf16": True, "tf32": False},
}



TRAITS: Mapping[str, FrameworkTraits] = {
    "lightning": FrameworkTraits(
        "lightning", ("fp32", "tf32", "fp16-mixed", "bf16-mixed", "fp16-true", "bf16-true", "fp8-te"),
        sets_micro_batch=False, loss_scale_kinds=("dynamic", "static", "none"), loss_scale_settings=True,
        fp8_recipes={"fp8-te": ("delayed",)},
        limits=(
            "the micro-batch is the script's DataLoader batch_size, so no split is searched",
            "fp8-torchao has no Lightning precision plugin",
            "fp8-te runs Transformer Engine's delayed recipe only (the plugin builds DelayedScaling)",
        ),
    ),
    "fabric": FrameworkTraits(
        "fabric", ("fp32", "tf32", "fp16-mixed", "bf16-mixed", "fp16-true", "bf16-true", "fp8-te"),
        sets_micro_batch=False, loss_scale_kinds=("dynamic", "static", "none"), loss_scale_settings=True,
        fp8_recipes={"fp8-te": ("delayed",)}, sets_grad_clip=False,
        limits=(
            "the micro-batch and any accumulation are the script's own, so no split is searched",
            "gradient clipping is the script's own (fabric.clip_gradients): a policy's grad_clip_norm is not applied",
            "fp8-torchao has no Fabric precision plugin",
            "fp8-te runs Transformer Engine's delayed recipe only (the plugin builds DelayedScaling)",
        ),
    ),
    "transformers": FrameworkTraits(
        "transformers", ("fp32", "tf32", "fp16-mixed", "bf16-mixed"),
        sets_micro_batch=True, loss_scale_kinds=("dynamic",), loss_scale_settings=False,
        needs_cuda=("fp16-mixed",),
        limits=(
            "TrainingArguments cannot set GradScaler's parameters: fp16 runs with the default dynamic scale",
            "no pure fp16/bf16 training (that is the model's dtype, set where the script loads it)",
            "no FP8 through TrainingArguments",
            # accelerate/accelerator.py (1.15), Accelerator.__init__: fp16 autocast and the
            # GradScaler are built only when `self.device.type != "cpu"`.
            "fp16-mixed needs a GPU: on a CPU fp16=True trains in fp32 (Accelerate builds neither fp16 autocast "
            "nor a GradScaler there), so a trial of it ends unsupported",
        ),
    ),
    "accelerate": FrameworkTraits(
        "accelerate", ("fp32", "tf32", "fp16-mixed", "bf16-mixed", "fp8-te", "fp8-torchao"),
        sets_micro_batch=False, loss_scale_kinds=("dynamic", "none"), loss_scale_settings=True,
        fp8_recipes={"fp8-te": ("delayed", "mxfp8"), "fp8-torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp")},
        sets_grad_clip=False,
        limits=(
            "the micro-batch is the script's DataLoader batch_size, so no split is searched",
            "no static loss scale: GradScalerKwargs builds a dynamic GradScaler",
            "no pure fp16/bf16 training (that is the model's dtype, set by the script)",
            "fp8-te: Accelerate builds the delayed and mxfp8 recipes only, not current or block",
            # accelerate/utils/transformer_engine.py, convert_model (1.15): it swaps each Linear
            # whose weight dims are multiples of 16, and LayerNorms, with no filter to pass.
            "fp8-te: Accelerate swaps Linear layers by its own rule (weight dimensions multiples of 16, "
            "LayerNorms too), not mpadvise's FP8 layer filter",
        ),
    ),
}


def traits(framework: str) -> FrameworkTraits:
    """The traits of one built-in framework (transitional; ``_registry.traits`` derives them)."""
    if framework not in TRAITS:
        raise UsageError(f"unknown framework {framework!r}; expected one of {', '.join(TRAITS)}")
    return TRAITS[framework]
