"""Lightning's Trainer and Fabric (every flavour installed: ``lightning`` and the standalone
``pytorch_lightning``/``lightning_fabric``): the policy's precision settings in place of whatever
the script passes (``lightning_precision``); steps are recorded by ``_lightning_record``.
Lightning is imported inside ``install()`` only.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.frameworks._adapter import (
    Application,
    FrameworkAdapter,
    fp16_loss_scale,
    hold_switches,
    shift_seed,
    wrap_once,
)
from advisor.frameworks._lightning_record import FabricSteps, TrainerSteps, as_list, policy_scaler
from policies import Fp8Options, LossScale, Policy
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

# The flavours of Lightning: the unified package and the standalone ones, each with its own
# classes (a Trainer of one takes plugins and callbacks of the same one only).
TRAINER_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
FABRIC_PACKAGES = ("lightning.fabric", "lightning_fabric")
_SEED_MODULES = ("lightning.fabric.utilities.seed", "lightning_fabric.utilities.seed")
_LIGHTNING_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")
# Lightning's seed bounds (numpy's uint32).
_SEED_RANGE = 2**32

# Lightning's precision strings by (weights, autocast), where the string is exact.
_PRECISION: Mapping[tuple[str, str | None], str] = {
    ("fp32", None): "32-true", ("fp32", "bf16"): "bf16-mixed",
    ("bf16", None): "bf16-true", ("fp16", None): "16-true",
}


@dataclass(frozen=True)
class LightningPrecision:
    """How the Trainer and Fabric apply one Policy: Lightning's precision string, or a ``plugin``
    where the string is not exact, and the TF32 switch (``None``: left as it is). fp16 autocast is
    ``"amp"``: ``MixedPrecision`` carrying the policy's GradScaler (the string builds a default one,
    and on a CPU turns fp16 into bf16); Transformer Engine FP8 is ``"transformer-engine"``:
    ``TransformerEnginePrecision`` with fp32 weights (the string means bf16 weights)."""

    precision: str
    plugin: str | None = None
    loss_scale: LossScale | None = None
    tf32: bool | None = None

    def describe(self) -> str:
        if self.plugin == "amp":
            ls = self.loss_scale or LossScale()
            return (f"MixedPrecision('16-mixed') with a {ls.kind} GradScaler (scale {ls.init_scale:g}"
                    + (f", growth interval {ls.growth_interval}" if ls.kind == "dynamic" else "") + ")")
        if self.plugin == "transformer-engine":
            return "TransformerEnginePrecision with fp32 weights and the delayed FP8 recipe"
        return f"precision={self.precision!r}"


def lightning_precision(policy: Policy) -> LightningPrecision:
    """What the Trainer and Fabric must be given to run ``policy``, from its mode's facts."""
    facts = LightningTrainer.facts_for(policy)
    if facts.fp8_library is not None:  # Transformer Engine: the plugin, with fp32 weights
        return LightningPrecision("transformer-engine", plugin="transformer-engine", tf32=facts.tf32)
    if facts.autocast == "fp16":
        loss_scale = fp16_loss_scale(policy)
        return LightningPrecision("16-mixed", plugin="amp", loss_scale=loss_scale, tf32=facts.tf32)
    return LightningPrecision(_PRECISION[facts.weights, facts.autocast], tf32=facts.tf32)


def transformer_engine_args(policy: Policy) -> dict[str, Any]:
    """The keyword arguments of Lightning's ``TransformerEnginePrecision`` for an fp8-te policy:
    fp32 weights, bf16 autocast for what TE does not run in FP8 (as the loop API's fp8-te), dtypes
    named so that this stays free of torch, and a recipe Lightning turns into ``DelayedScaling``."""
    fp8 = policy.fp8 or Fp8Options()
    recipe = fp8.recipe or "delayed"
    if recipe != "delayed":
        raise MpadviseError(
            f"Lightning's TransformerEnginePrecision builds Transformer Engine's delayed recipe only, "
            f"not {recipe!r}; set [fp8] recipe = \"delayed\" or train through the loop API"
        )
    return {
        "weights_dtype": "float32",
        "fallback_compute_dtype": "bfloat16",
        "recipe": {"fp8_format": fp8.fp8_format.upper(), "amax_history_len": fp8.amax_history_len,
                   "margin": fp8.margin},
    }


def shifted_seed(seed: int, shift: int) -> int:
    """The script's seed moved by the trial's seed (0 leaves it), within Lightning's bounds."""
    if not shift or not 0 <= seed < _SEED_RANGE:
        return seed  # out of bounds: Lightning's own error says so
    return (seed + shift) % _SEED_RANGE


def is_sharded(strategy: Any) -> bool:
    """Whether a strategy (a name or an instance) builds its own precision plugin from the string
    (FSDPPrecision, DeepSpeedPrecision), dropping a scaler passed to it."""
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    return any(kind in name.lower() for kind in ("fsdp", "deepspeed"))


class _LightningPrecisionPlugins(FrameworkAdapter):
    """What the Trainer and Fabric share: Lightning's precision plugins."""

    autocasts = ("bf16", "fp16")
    half_weights = ("bf16", "fp16")
    fp8 = {"transformer_engine": ("delayed",)}
    loss_scale_kinds = ("dynamic", "static", "none")
    loss_scale_settings = True


class LightningTrainer(_LightningPrecisionPlugins):
    """Lightning's Trainer: its precision flag or plugin, accumulation and clipping arguments."""

    name = "lightning"
    label = "Lightning's Trainer"
    # The Trainer's own modules in each flavour, and LightningCLI, which builds and runs one.
    detected_by = {
        "lightning": ("Trainer",),
        **{f"{package}{module}": ("Trainer",) for package in ("lightning.pytorch", "pytorch_lightning")
           for module in ("", ".trainer", ".trainer.trainer")},
        **{f"{package}.cli": ("LightningCLI",) for package in ("lightning.pytorch", "pytorch_lightning")},
    }
    precedence = 10

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        application = _prepare(policy, recorder, device)
        for package in _installed(TRAINER_PACKAGES):
            _patch_init(importlib.import_module(package).Trainer, package, application.trainer_kwargs,
                        lambda trainer: application.applied())


class LightningFabric(_LightningPrecisionPlugins):
    """Lightning Fabric: the same precision plugins as the Trainer; the loop is the script's."""

    name = "fabric"
    label = "Lightning Fabric"
    detected_by = {module: ("Fabric",) for module in ("lightning", "lightning.fabric", "lightning_fabric")}
    precedence = 30
    sets_grad_clip = False

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        application = _prepare(policy, recorder, device)
        if os.environ.pop("LT_PRECISION", None) is not None and recorder is not None:
            recorder.note("LT_PRECISION left out: the candidate's precision applies")
        for package in _installed(FABRIC_PACKAGES):
            fabric_cls = importlib.import_module(package).Fabric
            _patch_init(fabric_cls, package, application.fabric_kwargs,
                        lambda fabric: application.applied(fabric.device))
            if recorder is not None:
                application.fabric_steps.patch(fabric_cls)


def _prepare(policy: Policy, recorder: FrameworkRecorder | None, device: str | None) -> _Application:
    """What both entries do first: the plan, the process switches and the seeds."""
    application = _Application(policy, lightning_precision(policy), recorder, device)
    application.note(hold_switches(policy, device))
    if recorder is None or not recorder.spec.seed:
        return application
    shift = recorder.spec.seed
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is not None and env.lstrip("-").isdigit():  # seed_everything() with no seed reads it
        os.environ["PL_GLOBAL_SEED"] = str(shifted_seed(int(env), shift))
    for name in _installed(_SEED_MODULES):
        original = importlib.import_module(name).seed_everything
        # Every module that re-exports it (lightning.seed_everything, Fabric's staticmethod's
        # global, lightning.pytorch.seed_everything) holds the original object: replace each.
        owners = [module for loaded, module in list(sys.modules.items())
                  if loaded.split(".")[0] in _LIGHTNING_ROOTS and getattr(module, "seed_everything", None) is original]
        # No seed: Lightning's default seed 0, moved, unless PL_GLOBAL_SEED gives one.
        shift_seed(owners, "seed_everything", recorder, move=lambda seed: shifted_seed(seed, shift),
                   default=lambda: None if "PL_GLOBAL_SEED" in os.environ else shifted_seed(0, shift))
    return application


def _installed(packages: Iterable[str]) -> list[str]:
    found = []
    for package in packages:
        with contextlib.suppress(ModuleNotFoundError):  # lightning.pytorch when lightning itself is absent
            if importlib.util.find_spec(package) is not None:
                found.append(package)
    return found


def _patch_init(cls: type, package: str, adjust: Callable[[str, dict[str, Any]], dict[str, Any]],
                built: Callable[[Any], None]) -> None:
    """Wrap ``cls.__init__``: ``adjust(package, kwargs)`` rewrites its arguments; ``built(obj)``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **adjust(package, kwargs))
            built(self)

        return __init__

    wrap_once(cls, "__init__", make)


class _Application(Application):
    """What ``install()`` decided, applied to each Trainer or Fabric the script builds."""

    def __init__(self, policy: Policy, plan: LightningPrecision, recorder: FrameworkRecorder | None,
                 device: str | None) -> None:
        super().__init__(policy, recorder, device)
        self.plan = plan
        self.trainer_steps = TrainerSteps(recorder) if recorder is not None else None
        self.fabric_steps = FabricSteps(recorder) if recorder is not None else None

    def _kwargs(self, package: str, kwargs: dict[str, Any], *, who: str,
                attr: str) -> dict[str, Any]:
        """The script's arguments on the trial's device, with the policy's precision for theirs;
        ``attr``: where a strategy instance holds a precision plugin of its own."""
        kwargs = dict(kwargs)
        if self.device is not None:
            import torch

            device = torch.device(self.device)
            kwargs["accelerator"] = device.type
            if device.index is not None:
                kwargs["devices"] = [device.index]
            elif device.type == "cpu" and not isinstance(kwargs.get("devices", "auto"), int):
                kwargs["devices"] = "auto"  # a list of GPU indices means nothing on the CPU
        plugins_module = importlib.import_module(f"{package}.plugins.precision")
        base, asked = plugins_module.Precision, kwargs.pop("precision", None)
        plugins = as_list(kwargs.get("plugins"))
        theirs = [type(p).__name__ for p in plugins if isinstance(p, base)]
        plugins = [p for p in plugins if not isinstance(p, base)]
        strategy = kwargs.get("strategy", "auto")
        held = None if isinstance(strategy, str) else getattr(strategy, f"_{attr}", None)
        if held is not None:
            # A strategy instance built with its own precision plugin: Lightning would take it
            # over the precision flag.
            setattr(strategy, attr, None)
            theirs.append(type(held).__name__)
        plan = self.plan
        if plan.plugin is None or (plan.plugin == "amp" and is_sharded(strategy)):
            if plan.plugin == "amp" and plan.loss_scale != LossScale():
                name = strategy if isinstance(strategy, str) else type(strategy).__name__
                raise MpadviseError(
                    f"{who} with strategy {name} builds its own loss scaler and cannot apply "
                    f"{self.policy.describe()}; use fp16-mixed with GradScaler's default dynamic scale "
                    "(initial scale 65536, growth interval 2000), or another mode"
                )
            kwargs["precision"] = plan.precision
            applied = f"precision={plan.precision!r}"
        else:
            kwargs["precision"] = None  # explicit, so that PL_TRAINER_PRECISION cannot add one
            if plan.plugin == "amp":
                device = _amp_device(kwargs.get("accelerator", "auto"))
                scaler = policy_scaler(device, plan.loss_scale)
                plugin = plugins_module.MixedPrecision("16-mixed", device, scaler=scaler)
            else:
                import torch

                te_args = transformer_engine_args(self.policy)
                plugin = plugins_module.TransformerEnginePrecision(
                    weights_dtype=getattr(torch, te_args["weights_dtype"]),
                    fallback_compute_dtype=getattr(torch, te_args["fallback_compute_dtype"]),
                    recipe=te_args["recipe"],
                )
            plugins.append(plugin)
            applied = plan.describe()
        kwargs["plugins"] = plugins or None
        was = asked if asked is not None else (", ".join(theirs) if theirs else None)
        self.note(f"{who}: {applied}" + (f" (the script asked for {was!r})" if was is not None else ""))
        return kwargs

    def trainer_kwargs(self, package: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = self._kwargs(package, kwargs, who="Lightning Trainer", attr="precision_plugin")
        policy = self.policy
        if policy.grad_accum_steps is not None:
            kwargs["accumulate_grad_batches"] = policy.grad_accum_steps
        if policy.grad_clip_norm is not None:
            kwargs["gradient_clip_val"] = policy.grad_clip_norm
            kwargs["gradient_clip_algorithm"] = "norm"
        if self.trainer_steps is not None:
            self.trainer_steps.trainer_kwargs(package, kwargs)
        return kwargs

    def fabric_kwargs(self, package: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = self._kwargs(package, kwargs, who="Lightning Fabric", attr="precision")
        if self.policy.grad_accum_steps not in (None, 1) or self.policy.grad_clip_norm is not None:
            get_logger().warning(
                "Fabric leaves accumulation and clipping to the script (fabric.backward, "
                "fabric.clip_gradients): the policy's grad_accum_steps and grad_clip_norm are not applied"
            )
        if self.fabric_steps is not None:
            kwargs["callbacks"] = [*as_list(kwargs.get("callbacks")), self.fabric_steps]
        return kwargs


def _amp_device(accelerator: Any) -> str:
    """The autocast device of ``MixedPrecision`` for a Trainer's or Fabric's ``accelerator``."""
    import torch

    if isinstance(accelerator, str):
        name = accelerator.lower()
    else:  # an Accelerator instance: CPUAccelerator, CUDAAccelerator, MPSAccelerator
        name = type(accelerator).__name__.removesuffix("Accelerator").lower()
    mps_available = torch.backends.mps.is_available()
    if name == "auto":
        name = "mps" if mps_available else "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "gpu":
        name = "mps" if mps_available else "cuda"
    if name not in ("cpu", "cuda", "mps"):
        raise MpadviseError(
            f"fp16-mixed through Lightning runs on cpu, cuda or mps; the script's accelerator is {accelerator!r}"
        )
    return name


