"""The Hugging Face Trainer adapter: a policy applied through ``TrainingArguments``, steps
recorded through the Trainer's own hooks. ``TrainingArguments.__post_init__`` derives
``mixed_precision`` from ``fp16``/``bf16`` once for the Trainer's Accelerator, so the candidate's
fields are set at its start. The Trainer's Accelerator and first forward are then checked: a trial
that would not run the candidate's precision ends unsupported instead of measuring something else.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.frameworks._adapter import (
    TORCH_DTYPE,
    Application,
    FrameworkAdapter,
    StepLosses,
    around,
    batch_size_of,
    hold_switches,
    shift_seed,
    wrap_once,
)
from advisor.runtime import BatchSplit, batch_split, current_world_size
from advisor.trial import EXIT_UNSUPPORTED, end_trial_process
from policies import Policy, mode_facts

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

# What a trial turns off: work that only slows a short trial window (reporting to trackers,
# checkpoints, pushes to the Hub, progress bars) and changes no numerics. NaN losses are
# kept in the script's own logs too, so what it prints agrees with what the trial records.
TRIAL_ARGUMENTS: Mapping[str, Any] = {
    "logging_nan_inf_filter": False, "report_to": "none", "save_strategy": "no", "push_to_hub": False,
    "load_best_model_at_end": False, "disable_tqdm": True,
}
# The TrainingArguments fields that argument_changes reads from the script's arguments.
SCRIPT_FIELDS = ("fp16", "bf16", "tf32", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "max_grad_norm", "data_seed", "lr_scheduler_type", "use_cpu")
# Evaluation inside the window would be timed as training; these schedulers need it, though.
_SCHEDULERS_NEEDING_EVAL = ("reduce_lr_on_plateau", "greedy")


class HuggingFaceTrainer(FrameworkAdapter):
    """The Hugging Face Trainer: ``TrainingArguments``' precision, batch and clipping fields."""

    name = "transformers"
    label = "the Hugging Face Trainer"
    detected_by = {"transformers": ("Trainer", "Seq2SeqTrainer")}
    precedence = 20
    autocasts = ("bf16", "fp16")
    # accelerate/accelerator.py (1.15), Accelerator.__init__: fp16 autocast and the GradScaler
    # are built only when `self.device.type != "cpu"`.
    cuda_only_autocasts = ("fp16",)
    sets_micro_batch = True
    loss_scale_kinds = ("dynamic",)
    loss_scale_settings = False

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        import torch
        import transformers
        import transformers.trainer
        import transformers.trainer_utils
        import transformers.training_args

        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        available = accelerator.is_available if hasattr(accelerator, "is_available") else torch.cuda.is_available
        use_cpu = device == "cpu" or (device is None and not available())
        hold_switches(policy, torch.device("cpu" if use_cpu else (device or "cuda")))
        # What TrainingArguments falls back to when fp16 and bf16 are both off, and what an
        # Accelerator the script builds by itself reads.
        os.environ["ACCELERATE_MIXED_PRECISION"] = accelerator_precision(policy.mode)
        hooks = TrainerHooks(policy, recorder, use_cpu=use_cpu, device=device,
                             callback_base=transformers.TrainerCallback)
        # __post_init__ sets the policy's fields first (subclasses inherit it or call it); __init__
        # re-checks the arguments' precision, then hooks the built trainer.
        wrap_once(transformers.training_args.TrainingArguments, "__post_init__",
                  around(hooks.before_arguments, hooks.after_arguments))
        wrap_once(transformers.trainer.Trainer, "__init__", around(hooks.before_trainer, hooks.after_trainer))
        if recorder is not None:
            # Wherever the script or the Trainer (which seeds args.seed, 42 by default) takes them from.
            for name in ("set_seed", "enable_full_determinism"):
                shift_seed([transformers, transformers.trainer, transformers.trainer_utils], name, recorder)


def transformers_precision(policy: Policy) -> dict[str, bool]:
    """The ``TrainingArguments`` precision fields (``fp16``, ``bf16``, ``tf32``) for ``policy`` (pure).
    A mode that leaves TF32 alone gets ``tf32=False``, the field's meaning of "not asked"."""
    facts = HuggingFaceTrainer.facts_for(policy)
    return {"fp16": facts.autocast == "fp16", "bf16": facts.autocast == "bf16", "tf32": facts.tf32 is True}


@dataclass(frozen=True)
class ArgumentChanges:
    """What the adapter sets in one ``TrainingArguments`` (``values``, before ``__post_init__``
    derives anything), the split applied, the script's own samples per step per device, and notes."""

    values: Mapping[str, Any]
    split: BatchSplit | None
    user_batch: int | None
    notes: tuple[str, ...]


def argument_changes(policy: Policy, script: Mapping[str, Any], *, trial: bool, seed_shift: int = 0,
                     use_cpu: bool = False) -> ArgumentChanges:
    """The ``TrainingArguments`` fields that apply ``policy`` over the script's values of
    ``SCRIPT_FIELDS`` (pure); in a trial, what only slows it is turned off too."""
    precision = transformers_precision(policy)
    values: dict[str, Any] = dict(precision)
    asked = {k: script.get(k) for k in precision if script.get(k) != precision[k]}
    # tf32=None (the default) leaves TF32 alone; the mode's False is stated, not an override.
    asked = {k: v for k, v in asked.items() if not (k == "tf32" and v is None)}
    said = ", ".join(f"{k}={v}" for k, v in precision.items())
    note = f"TrainingArguments({said}) for {policy.mode}"
    if asked:
        note += " where the script's arguments had " + ", ".join(f"{k}={v}" for k, v in asked.items())
    notes = [note]
    if use_cpu and not script.get("use_cpu"):
        values["use_cpu"] = True
        notes.append("use_cpu=True: training runs on the CPU, where the Trainer takes bf16=True only with it")
    per_device = _positive(script.get("per_device_train_batch_size"))
    accum = _positive(script.get("gradient_accumulation_steps")) or 1
    user_batch = None if per_device is None else per_device * accum
    split = None
    if user_batch is not None and (policy.micro_batch_size is not None or policy.grad_accum_steps is not None):
        split = batch_split(policy, user_batch)
        values["per_device_train_batch_size"] = split.micro
        values["gradient_accumulation_steps"] = split.accum
        notes.append(
            f"per_device_train_batch_size={split.micro}, gradient_accumulation_steps={split.accum} over the "
            f"script's {per_device} x {accum}: " + (split.note or f"global batch {split.micro * split.accum} kept")
        )
    if policy.grad_clip_norm is not None:
        values["max_grad_norm"] = float(policy.grad_clip_norm)
        notes.append(f"max_grad_norm={policy.grad_clip_norm:g} over the script's {script.get('max_grad_norm')}")
    if seed_shift and script.get("data_seed") is not None:
        values["data_seed"] = int(script["data_seed"]) + seed_shift
    if trial:
        values.update(TRIAL_ARGUMENTS)
        off = ["logging_nan_inf_filter=False (NaN losses reach the script's logs)", "report_to=none",
               "save_strategy=no", "no Hub push", "no progress bar"]
        scheduler = script.get("lr_scheduler_type")  # SchedulerType.LINEAR's value is "linear"
        if str(getattr(scheduler, "value", scheduler)) not in _SCHEDULERS_NEEDING_EVAL:
            values["eval_strategy"] = "no"
            values["do_eval"] = False
            off.append("no evaluation")
        notes.append("trial settings: " + ", ".join(off))
    return ArgumentChanges(values, split, user_batch, tuple(notes))


def expected_autocast(mode: str) -> str | None:
    autocast = mode_facts(mode).autocast
    return None if autocast is None else TORCH_DTYPE[autocast]


def accelerator_precision(mode: str) -> str:
    """The ``mixed_precision`` the Trainer's Accelerator runs ``mode`` in (``"no"``, ``"bf16"``, ``"fp16"``)."""
    return mode_facts(mode).autocast or "no"


def autocast_mismatch(mode: str, *, enabled: bool, dtype: str, device_type: str) -> str | None:
    """Why the observed autocast of a forward is not ``mode``'s, or ``None`` when it is (pure)."""
    want = expected_autocast(mode)
    if want is None and enabled:
        return (f"the forward ran under {device_type} autocast to {dtype}, not in fp32 as {mode} asks: "
                "the script or its Trainer subclass autocasts by itself")
    if want is not None and not enabled:
        return f"the forward ran without autocast, not under {device_type} autocast to {want} as {mode} asks"
    if want is not None and dtype != want:
        return f"the forward ran under {device_type} autocast to {dtype}, not {want} as {mode} asks"
    return None


def accelerator_mismatch(mode: str, *, mixed_precision: str, native_amp: bool, has_scaler: bool,
                         device_type: str) -> str | None:
    """Why the Trainer's Accelerator does not run ``mode``, or ``None`` when it does (pure)."""
    want = accelerator_precision(mode)
    if mixed_precision != want:
        return (f"the Hugging Face Trainer's Accelerator runs mixed_precision={mixed_precision!r}, not {want!r} "
                f"as {mode} asks (a Trainer subclass or the launch configuration sets its own)")
    if want == "fp16" and not (native_amp and has_scaler):
        return (f"the Hugging Face Trainer cannot run {mode} on {device_type}: Accelerate builds fp16 "
                "autocast and a GradScaler only on GPUs, so TrainingArguments(fp16=True) trains in fp32 here")
    if want == "bf16" and not native_amp:
        return f"the Hugging Face Trainer's Accelerator does not autocast to bf16 on {device_type}"
    return None


def scaler_skipped(before: float | None, after: float | None) -> bool:
    """Whether a dynamic GradScaler skipped the step: it backs the scale off exactly then (pure).

    Accelerate's ``step_was_skipped`` misses it for a fused optimizer (the Trainer's default),
    whose ``step`` GradScaler always calls and which then skips by itself.
    """
    return before is not None and after is not None and after < before


class TrainerHooks(Application):
    """What the patched ``TrainingArguments`` and ``Trainer`` call, and the step records."""

    def __init__(self, policy: Policy, recorder: FrameworkRecorder | None, *, use_cpu: bool, device: str | None,
                 callback_base: type) -> None:
        super().__init__(policy, recorder, device)
        self.use_cpu = use_cpu
        self.callback_base = callback_base
        self.mixed_precision = accelerator_precision(policy.mode)
        self.user_batch: int | None = None
        self.step = StepLosses()
        self._loss_scale: float | None = None  # what the GradScaler's scale is now, once read
        self._forward: tuple[bool, str, str] | None = None  # autocast in the first forward
        self._forward_checked = False
        self._forward_hooks: list[Any] = []

    def before_arguments(self, args: Any) -> None:
        """Set the policy's fields, before ``__post_init__`` derives ``mixed_precision``."""
        changes = argument_changes(
            self.policy, {name: getattr(args, name, None) for name in SCRIPT_FIELDS}, trial=self.recorder is not None,
            seed_shift=self.recorder.spec.seed if self.recorder is not None else 0, use_cpu=self.use_cpu,
        )
        for name, value in changes.values.items():
            setattr(args, name, value)
        self.user_batch = changes.user_batch
        for text in changes.notes:
            self.note(text)
        if changes.split is not None and changes.split.warning:
            get_logger().warning(changes.split.note)

    def after_arguments(self, args: Any) -> None:
        """A trial trains on one device: no DataParallel over every visible GPU, and ``cuda:N`` as asked."""
        state = args.distributed_state
        if self.recorder is None or state is None or state.distributed_type != "NO":
            return
        import torch

        if self.device is not None and self.device.startswith("cuda:"):
            wanted = torch.device(self.device)
            if args.device != wanted:
                torch.cuda.set_device(wanted)
                args.__dict__["_setup_devices"] = wanted  # the cached property HF reads as args.device
        if getattr(args, "_n_gpu", 1) > 1:
            args._n_gpu = 1

    def before_trainer(self, trainer: Any, *given: Any, **named: Any) -> None:
        """Set the precision again where the script changed it on the arguments after building them."""
        args = named["args"] if "args" in named else (given[1] if len(given) > 1 else None)
        if args is None or getattr(args, "mixed_precision", self.mixed_precision) == self.mixed_precision:
            return
        for name, value in transformers_precision(self.policy).items():
            if name != "tf32":
                setattr(args, name, value)
        args.mixed_precision = self.mixed_precision
        self.note(f"the script changed TrainingArguments' precision after building them: set back to {self.policy.mode}")

    def after_trainer(self, trainer: Any) -> None:
        accelerator = trainer.accelerator
        device_type = trainer.args.device.type
        if not getattr(trainer, "is_deepspeed_enabled", False):
            reason = accelerator_mismatch(
                self.policy.mode, mixed_precision=str(accelerator.mixed_precision),
                native_amp=bool(getattr(accelerator, "native_amp", False)),
                has_scaler=getattr(accelerator, "scaler", None) is not None, device_type=device_type,
            )
            if reason is not None:
                self._refuse(reason)
        self.note(f"the Trainer's Accelerator runs mixed_precision={accelerator.mixed_precision} on {trainer.args.device}")
        self.applied(trainer.args.device)  # the Trainer and its Accelerator run the candidate
        # A TrainerCallback of the script's transformers: its events feed this trainer's records.
        trainer.add_callback(type("MpadviseSteps", (self.callback_base,), {
            "on_train_begin": lambda callback, args, state, control, **kwargs: self.train_begin(
                trainer, kwargs.get("optimizer")),
            "on_step_end": lambda callback, args, state, control, **kwargs: self.step_end(trainer),
        })())
        step = trainer.training_step  # the most derived one: a subclass's override included
        trainer.training_step = lambda *a, **kw: self.training_step(trainer, step, *a, **kw)

    def training_step(self, trainer: Any, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One micro-batch: its loss (already divided for accumulation) joins the step's sum."""
        if self.recorder is not None and not self.recorder.begun:
            self.recorder.begin(user_batch=self.user_batch, micro_batch=trainer.args.per_device_train_batch_size,
                                grad_accum_steps=trainer.args.gradient_accumulation_steps)
        if self._loss_scale is None:
            self._loss_scale = _scale(trainer)
        loss = step(*args, **kwargs)
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        self.step.add(loss, batch_size_of(inputs))
        if not self._forward_checked:
            self._check_forward()
        return loss

    def train_begin(self, trainer: Any, optimizer: Any) -> None:
        if self.recorder is not None:
            self.recorder.perturb(trainer.model)
            self.recorder.watch_model(trainer.model)
            # user_batch is per device; the workload's global batch counts every process.
            every_process = None if self.user_batch is None else self.user_batch * current_world_size()
            self.recorder.workload(trainer.model, getattr(optimizer, "optimizer", optimizer), global_batch=every_process)
        if not trainer.args.torch_compile and not self._forward_checked:
            self._watch_forward(trainer.model, trainer.args.device.type)

    def step_end(self, trainer: Any) -> None:
        """The optimizer stepped: the step's loss, the scale its backward ran with, and whether it was skipped."""
        # The GradScaler changes its scale only in the optimizer step's update(), so the scale
        # before this step is the one the previous step left (or the first read).
        before, after = self._loss_scale, _scale(trainer)
        self._loss_scale = after
        if self.recorder is None or not self.step.losses:
            self.step.reset()
            return
        skipped = scaler_skipped(before, after) or bool(trainer.accelerator.optimizer_step_was_skipped)
        self.step.record(self.recorder, before, skipped, mean=False)

    def _watch_forward(self, model: Any, device_type: str) -> None:
        """Note the autocast state inside the first forward (a submodule runs inside Accelerate's
        autocast wrapper of the model's forward; the model's own hooks run outside it)."""
        import torch

        def seen(module: Any, inputs: Any) -> None:
            if self._forward is None:
                dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
                self._forward = (torch.is_autocast_enabled(device_type), dtype, device_type)

        submodules = [module for name, module in model.named_modules() if name]
        self._forward_hooks += [module.register_forward_pre_hook(seen) for module in submodules]

    def _check_forward(self) -> None:
        """The first training step is done: check what its forward ran under, once."""
        self._forward_checked = True
        for handle in self._forward_hooks:
            handle.remove()
        seen = self._forward
        if seen is None:
            return  # a model without submodules, or a compiled one: the Accelerator check stands alone
        enabled, dtype, device_type = seen
        reason = autocast_mismatch(self.policy.mode, enabled=enabled, dtype=dtype, device_type=device_type)
        if reason is not None:
            self._refuse(reason)
        self.note(f"the first forward ran under {device_type} autocast to {dtype}" if enabled
                   else "the first forward ran without autocast")

    def _refuse(self, reason: str) -> None:
        """End the run: a trial as unsupported (it cannot run the candidate), a run with one error line."""
        if self.recorder is not None:
            self.recorder.writer.write(stage="unsupported", reason=reason)
            end_trial_process(EXIT_UNSUPPORTED)
        sys.stderr.write(f"error: {reason}\n")
        raise SystemExit(1)


def _scale(trainer: Any) -> float | None:
    scaler = getattr(trainer.accelerator, "scaler", None)
    return None if scaler is None else float(scaler.get_scale())


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

