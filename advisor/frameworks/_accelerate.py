"""Accelerate: apply a Policy through ``Accelerator``'s own settings (``mixed_precision`` and the
kwargs handlers, replacing the script's), and record a trial's steps (``_accelerate_record``).
Accelerate is imported inside ``install()`` only: this module runs in the trial child.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from advisor.frameworks._accelerate_record import Steps
from advisor.frameworks._adapter import (
    Application,
    FrameworkAdapter,
    around,
    fp16_loss_scale,
    hold_switches,
    scaler_kwargs,
    shift_seed,
    wrap_once,
)
from policies import Fp8Options, LossScale, Policy, create_mode
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

@dataclass(frozen=True)
class AccelerateSettings:
    """What an ``Accelerator`` is given to run one Policy: ``mixed_precision``, the kwargs
    handlers' fields, and the TF32 switch (``None``: left as it is)."""

    mixed_precision: str
    grad_scaler: dict[str, Any] | None = None
    te_recipe: dict[str, Any] | None = None
    torchao_recipe: str | None = None
    tf32: bool | None = None

    def describe(self) -> str:
        text = f"mixed_precision={self.mixed_precision!r}"
        if self.grad_scaler is not None:
            fields = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.grad_scaler.items())
            text += f" with GradScalerKwargs({fields})"
        if self.te_recipe is not None:
            fields = ", ".join(f"{k}={v!r}" for k, v in self.te_recipe.items())
            text += f" with TERecipeKwargs({fields})"
        if self.torchao_recipe is not None:
            text += f" with AORecipeKwargs (torchao {self.torchao_recipe!r}, mpadvise's FP8 layer filter)"
        return text


def accelerate_settings(policy: Policy) -> AccelerateSettings:
    """What the Accelerator must be given to run ``policy``, from its mode's facts."""
    facts = AccelerateAdapter.facts_for(policy)
    if facts.fp8_library == "transformer_engine":
        return AccelerateSettings("fp8", te_recipe=te_recipe_kwargs(policy.fp8 or Fp8Options()), tf32=facts.tf32)
    if facts.fp8_library == "torchao":
        return AccelerateSettings("fp8", torchao_recipe=facts.fp8_recipe(policy), tf32=facts.tf32)
    if facts.autocast == "fp16":
        grad_scaler = grad_scaler_kwargs(fp16_loss_scale(policy))
        return AccelerateSettings("fp16", grad_scaler=grad_scaler, tf32=facts.tf32)
    return AccelerateSettings(facts.autocast or "no", tf32=facts.tf32)


def grad_scaler_kwargs(loss_scale: LossScale) -> dict[str, Any]:
    """``GradScalerKwargs`` fields for a policy's ``[loss_scale]`` (never static: Accelerate's is dynamic)."""
    if loss_scale.kind == "static":
        raise MpadviseError(
            "Accelerate cannot apply a static loss scale (GradScalerKwargs builds a dynamic GradScaler); "
            "use kind = \"dynamic\""
        )
    return {"enabled": False} if loss_scale.kind == "none" else scaler_kwargs(loss_scale)


def te_recipe_kwargs(fp8: Fp8Options) -> dict[str, Any]:
    """``TERecipeKwargs`` fields for the recipe the loop API's fp8-te builds. ``mxfp8`` gets no amax
    setting: Accelerate builds ``MXFP8BlockScaling()`` only without one."""
    recipe = fp8.recipe or "delayed"
    if recipe == "delayed":
        # TE's DelayedScaling scales from the largest amax of the history ("max"), as the loop
        # API's fp8-te builds it; TERecipeKwargs' default is "most_recent".
        return {"fp8_format": fp8.fp8_format.upper(), "amax_history_len": fp8.amax_history_len,
                "amax_compute_algo": "max", "margin": fp8.margin}
    if recipe == "mxfp8":
        return {"use_mxfp8_block_scaling": True}
    raise MpadviseError(
        f"Accelerate's TERecipeKwargs builds Transformer Engine's delayed and mxfp8 recipes only, not "
        f"{recipe!r}; set [fp8] recipe to \"delayed\" or \"mxfp8\", or train through the loop API"
    )


class AccelerateAdapter(FrameworkAdapter):
    """Accelerate: ``Accelerator(mixed_precision=..., kwargs_handlers=[...])``; the loop is the script's."""

    name = "accelerate"
    label = "Accelerate"
    detected_by = {"accelerate": ("Accelerator",)}
    precedence = 40
    autocasts = ("bf16", "fp16")
    fp8 = {"transformer_engine": ("delayed", "mxfp8"), "torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    loss_scale_kinds = ("dynamic", "none")
    loss_scale_settings = True
    sets_grad_clip = False

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        import accelerate
        import accelerate.utils
        import accelerate.utils.random
        from accelerate.optimizer import AcceleratedOptimizer

        application = _Application(policy, accelerate_settings(policy), recorder, device)
        application.note(hold_switches(policy, device))
        wrap_once(accelerate.Accelerator, "__init__", application.wrap_init)
        if recorder is None:
            return
        steps = application.steps = Steps(recorder)
        wrap_once(accelerate.Accelerator, "prepare", around(steps.before_prepare, steps.note_fp8))
        wrap_once(accelerate.Accelerator, "backward", around(steps.before_backward))
        for name in ("prepare_model", "prepare_optimizer"):
            wrap_once(accelerate.Accelerator, name, getattr(steps, f"wrap_{name}"))
        wrap_once(AcceleratedOptimizer, "step", steps.wrap_step)
        # Both import paths of set_seed find the wrapped one: the script imports after this runs.
        shift_seed([accelerate.utils, accelerate.utils.random], "set_seed", recorder)


class _Application(Application):
    """What ``install()`` decided, applied to each Accelerator the script builds."""

    def __init__(self, policy: Policy, settings: AccelerateSettings, recorder: FrameworkRecorder | None,
                 device: str | None) -> None:
        super().__init__(policy, recorder, device)
        self.settings = settings
        self.steps: Steps | None = None
        self.fp8_mode: Any = None  # fp8-torchao: the loop API's mode, whose filter and notes are used

    def wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        signature = inspect.signature(original)

        def __init__(accelerator: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(accelerator, *args, **kwargs)
            asked = bound.arguments.get("mixed_precision")
            bound.arguments["mixed_precision"] = self.settings.mixed_precision
            bound.arguments["kwargs_handlers"] = self._handlers(bound.arguments.get("kwargs_handlers"))
            # The trial's device: cpu=True for the CPU; a CUDA index becomes the current device,
            # which a single-process Accelerator trains on (PartialState picks "cuda").
            device = None if self.device is None else torch.device(self.device)
            if device is not None and device.type == "cpu":
                bound.arguments["cpu"] = True
            elif device is not None and device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            original(*bound.args, **bound.kwargs)
            self._built(accelerator, asked)

        return __init__

    def _handlers(self, given: Sequence[Any] | None) -> list[Any]:
        """The script's kwargs handlers with the policy's in place of those of the same kind."""
        import accelerate.utils as utils

        ours: list[Any] = []
        settings = self.settings
        if settings.grad_scaler is not None:
            ours.append(utils.GradScalerKwargs(**settings.grad_scaler))
        if settings.te_recipe is not None:
            ours.append(utils.TERecipeKwargs(**settings.te_recipe))
        if settings.torchao_recipe is not None:
            # The loop API's fp8-torchao config and layer filter. Accelerate's default config turns
            # on FSDP's float8 all-gather, which wraps each swapped weight in a new Parameter: an
            # optimizer built before prepare() keeps the old ones and the FP8 layers stop training
            # (accelerate 1.15, torchao 0.18). The loop API's config reuses the Linear's Parameter.
            import torch

            device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            mode = self.fp8_mode = create_mode(self.policy, device)
            ours.append(utils.AORecipeKwargs(config=mode.linear_config(),
                                             module_filter_func=mode.module_filter))
        # Every FP8 recipe kind goes: another backend's recipe would pick the backend
        # (Accelerator.fp8_backend reads the generic FP8RecipeKwargs first where it exists), and
        # outside fp8 Accelerate refuses any of them. Accelerate 1.16 dropped FP8RecipeKwargs and
        # MSAMPRecipeKwargs; earlier versions have them.
        older = ("FP8RecipeKwargs", "MSAMPRecipeKwargs")
        recipe_kinds = {utils.AORecipeKwargs, utils.TERecipeKwargs,
                        *(getattr(utils, name) for name in older if hasattr(utils, name))}
        replaced_kinds = {type(h) for h in ours} | recipe_kinds
        kept, replaced = [], []
        for handler in given or ():
            if type(handler) in replaced_kinds:
                replaced.append(type(handler).__name__)
            elif (isinstance(handler, utils.AutocastKwargs) and not handler.enabled
                  and settings.mixed_precision != "no"):  # autocast off: the forward in fp32
                kept.append(utils.AutocastKwargs(enabled=True, cache_enabled=handler.cache_enabled))
                replaced.append("AutocastKwargs(enabled=False)")
            else:
                kept.append(handler)
        if replaced:
            self.note(f"Accelerator: the script's {', '.join(replaced)} replaced by the policy's")
        return kept + ours

    def _built(self, accelerator: Any, asked: Any) -> None:
        """Check that the Accelerator runs the policy, and fill in what Accelerate leaves out."""
        want = self.settings.mixed_precision
        if accelerator.mixed_precision != want:
            raise MpadviseError(
                f"Accelerate runs mixed_precision={accelerator.mixed_precision!r} where the policy "
                f"{self.policy.describe()} needs {want!r} (an AcceleratorState built earlier in this "
                "process, or a DeepSpeed config, decides it); build the Accelerator before anything else "
                "of Accelerate"
            )
        if want == "fp16" and accelerator.device.type == "cpu" and accelerator.scaler is None:
            # Accelerate builds fp16 autocast and a GradScaler only off the CPU: with native_amp on,
            # prepare(), backward() and the AcceleratedOptimizer use them as on a GPU.
            import torch

            accelerator.scaler = torch.amp.GradScaler("cpu", **(self.settings.grad_scaler or {}))
            accelerator.native_amp = True
            self.note("Accelerator: fp16 on a CPU runs CPU autocast with GradScaler('cpu') "
                      "(Accelerate itself would train in fp32 there)")
        # Again: AcceleratorState turns TF32 on for mixed_precision="no" under a dynamo backend on CUDA.
        hold_switches(self.policy, self.device)
        was = f" (the script asked for {str(asked)!r})" if asked is not None else ""
        self.note(f"Accelerator: {self.settings.describe()}{was}")
        self.applied(accelerator.device)
        if self.steps is not None:
            self.steps.accelerators.append(accelerator)
            self.steps.fp8_mode = self.fp8_mode

