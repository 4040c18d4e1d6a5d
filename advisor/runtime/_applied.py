"""AppliedPolicy: the one object a training script uses to train under a Policy."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.runtime._device import _distributed_wrapper, rank_device
from advisor.runtime._fallback import fallback_words, guard_fallback, safe_fallback
from advisor.runtime._fsdp import _torch_dtypes, fsdp_policy_refusal, fsdp_precision
from advisor.runtime._guard import Guard, GuardEvent
from advisor.runtime._retarget import retarget_optimizer, upcast_in_place
from advisor.runtime._script import _args_now, _retune_hint, _script_args, _script_path, _with_args
from advisor.runtime._split import (
    BatchSplit,
    _leading_dim,
    batch_split,
    step_samples,
    tuned_global_batch,
)
from advisor.runtime._workload import (
    GLOBAL_BATCH,
    Workload,
    WorkloadMismatch,
    current_world_size,
    model_signature,
    workload_mismatch,
)
from policies import Difference, Policy, create_mode, mode_facts, safe_default
from probes import MpadviseError

if TYPE_CHECKING:
    import torch

    from probes import HardwareProfile


class StepObserver:
    """Receives what ``AppliedPolicy.setup`` and ``step`` did; the trial recorder implements it."""

    def after_setup(self, applied: AppliedPolicy, model: torch.nn.Module) -> None:
        """Called once ``setup()`` has moved and converted ``model``, before any step."""

    def before_step(self, applied: AppliedPolicy) -> None:
        """Called at the start of every ``step()``, before backward."""

    def after_backward(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> None:
        """Called after the gradients of an optimizer step are complete (unscaled if asked)."""

    def after_step(self, applied: AppliedPolicy, *, loss: float, stepped: bool, optimizer_step: bool) -> None:
        """Called at the end of every ``step()``; ``optimizer_step`` is False on accumulation steps."""


class AppliedPolicy:
    """A Policy applied to this process: set up the model, run forward/backward/step under it.

    Made by ``advisor.load_policy()``. Also a context manager: entering sets the mode's
    process-wide switches (TF32 matmul precision), leaving restores them exactly.

    A tuned policy is checked against the workload it was tuned on once the workload is known:
    ``setup()`` knows the model, the optimizer and the script, ``micro_batch_size()`` the
    global batch. A tune's answer (a cached one, or the config file a tune wrote beside the
    script) must match all of it; a config file the user named, or one written by hand, the
    model's structure. When the script was tuned on several workloads, the first answer tuned
    on this one applies (one info line). A miss switches to ``safe_fallback`` (the hardware's
    safe default, or the tuned mode where that is safer) with one warning that names what
    changed; the global batch stays what ``micro_batch_size()`` answered.

    Attributes:
        policy: the Policy in force.
        source: where the policy came from (``"MPADVISE_POLICY=/path"``, ``"safe default"``...).
        device: the torch device training runs on.
        profile: the hardware profile of that device.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        profile: HardwareProfile,
        source: str,
        device: str | torch.device | None = None,
        observer: StepObserver | None = None,
        match_workload: bool = False,
        alternatives: Sequence[tuple[Policy, str]] = (),
        guard: Guard | None = None,
        on_guard_event: Callable[[GuardEvent], None] | None = None,
    ) -> None:
        """Apply ``policy`` on ``profile``'s device.

        Args:
            policy: the policy to apply.
            profile: the hardware training runs on.
            source: where the policy came from, for log lines.
            device: overrides ``profile.device``.
            observer: receives what ``step()`` does (the trial recorder).
            match_workload: apply a tuned policy only to the whole workload it was tuned on
                (a tune's answer: cached, or the config file beside the script); otherwise
                only the model's structure is checked.
            alternatives: with ``match_workload``, the other tunes' answers for this script
                (``(policy, source)``, in order): when ``policy`` was tuned on another
                workload, the first tuned on this one applies instead. ``setup()`` chooses by
                the whole workload; a ``micro_batch_size()`` before it by the global batch.
            guard: watches the optimizer steps (``Guard``); none: off.
            on_guard_event: receives each event the guard records (the loader caches it).
        """
        import torch

        self.policy = policy
        self.profile = profile
        self.source = source
        # Under torchrun each process trains on its own GPU (LOCAL_RANK), unless one was named.
        self.device = torch.device(rank_device(device, profile.device, os.environ))
        self._mode = create_mode(policy, self.device)
        self._observer = observer
        self._match_workload = match_workload
        self._alternatives = list(alternatives) if match_workload else []
        self._user_batch: int | None = None
        self._other_batches: set[int] = set()  # later micro_batch_size() arguments (evaluation)
        self._split: BatchSplit | None = None
        self._workload: Workload | None = None
        # Whether setup()'s conversion changed the model (dtypes or modules): after it, the
        # mode can no longer be switched.
        self._converted = False
        self._mismatch_reported = False
        self._micro_step = 0
        self._switch_stack: list[contextlib.ExitStack] = []
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # Leading dimensions of what reached to_device() since the last step(): the batch the
        # current micro-step uses, for goodput (micro_step_samples).
        self._seen_batches: list[int] = []
        self.model_signature: str | None = None
        self.fsdp = False
        """Whether the script asked for FSDP2's mixed precision (``fsdp_mixed_precision()``)."""
        self._fsdp_checked = False
        self.guard = guard if guard is not None else Guard("off")
        self.on_guard_event = on_guard_event
        # False where a framework owns the precision: the guard then asks for a restart.
        self.in_place = True

    @property
    def mode(self) -> str:
        return self.policy.mode

    @property
    def notes(self) -> list[str]:
        """What the mode reported when converting the model (layers kept in high precision...)."""
        return list(self._mode.notes)

    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` where the mode does not scale the loss."""
        return self._mode.loss_scale()

    def micro_batch_size(self, default: int) -> int:
        """The batch size a DataLoader should use.

        The first call sets the training batch, the one ``step()`` trains on and the policy
        splits. A later call with another batch (an evaluation loader) gets its ``default``
        back unchanged: evaluation takes no optimizer step, so it has nothing to accumulate,
        and a tuned answer is judged on the training batch alone.

        Args:
            default: the script's own batch size, i.e. its global batch. With a policy that
                splits it (micro-batch 64 of a global 256), ``step()`` accumulates 256 // 64
                micro-batches per optimizer step so the optimisation stays the same. A tuned
                policy splits whatever batch the script asks for, so its global batch is kept;
                a hand-written one with ``grad_accum_steps`` takes the accumulation it states.

        Returns:
            The micro-batch size; ``default`` when the policy sets none, and on a later call
            with another batch.
        """
        if isinstance(default, bool) or not isinstance(default, int) or default <= 0:
            raise MpadviseError(f"micro_batch_size(default): {default!r} is not a batch size; expected a positive integer")
        if self._split is not None and self._user_batch is not None:
            return self._later_batch(default, self._split)
        self._user_batch = default
        mismatch = self._batch_mismatch(self.policy, default)
        if mismatch is not None and self.model is None:
            # Before setup(): another tune's answer at this batch may fit; setup() checks the rest.
            if self._apply_other_answer(mismatch, lambda policy: self._batch_mismatch(policy, default)):
                mismatch = None
        if mismatch is not None and not self._converted:
            self._fall_back(mismatch.reason(), _args_now(mismatch))
            mismatch = None
        self._split = batch_split(self.policy, default)
        if mismatch is not None:
            # A cached answer whose mode already converted the model in setup(): the model
            # cannot be taken back, so the mode stays, on the script's own global batch.
            self._mismatch_reported = True
            get_logger().warning(
                f"{mismatch.reason()}; keeping {self.policy.mode} from {self.source}, since setup() already "
                f"converted the model for it, with the global batch {default} "
                f"({self._split.describe()}); run `mpadvise tune` again"
            )
        elif self._split.note:
            log = get_logger().warning if self._split.warning else get_logger().info
            log(self._split.note)
        return self._split.micro

    def _later_batch(self, default: int, split: BatchSplit) -> int:
        """``micro_batch_size(default)`` after the first call: the training batch's micro-batch
        again, or ``default`` unchanged for another loader (with one line, once per batch)."""
        if default == self._user_batch:
            return split.micro
        if default not in self._other_batches:
            self._other_batches.add(default)
            get_logger().info(
                f"micro_batch_size({default}) after micro_batch_size({self._user_batch}): the first call set the "
                f"training batch ({split.describe()}); {default} is returned unchanged, as for an "
                "evaluation loader"
            )
        return default

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step (1 unless the policy splits the script's batch)."""
        if self._split is not None:
            return self._split.accum
        return self.policy.grad_accum_steps or 1

    @property
    def world_size(self) -> int:
        """How many processes train together: as ``setup()`` found it, else as now
        (``advisor.runtime._workload.current_world_size``)."""
        return self._workload.world_size if self._workload is not None else current_world_size()

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step over all processes (micro-batch x accumulation x world
        size), once ``micro_batch_size()`` has been called."""
        return None if self._split is None else self._split.micro * self._split.accum * self.world_size

    @property
    def workload_fingerprint(self) -> str | None:
        """Model structure, optimizer, world size, global batch and script: the cache key of
        this workload.

        Known after ``setup()``; the global batch (the script's own, times the world size)
        joins once ``micro_batch_size()`` was called.
        """
        if self._workload is None:
            return None
        return replace(self._workload, global_batch=self._global(self._user_batch)).fingerprint()

    def _global(self, per_process: int | None) -> int | None:
        """The global batch of a script batch ``per_process`` on every process of this run."""
        return None if per_process is None else per_process * self.world_size

    @property
    def user_batch(self) -> int | None:
        """The batch size the script asked for (the argument of ``micro_batch_size``)."""
        return self._user_batch

    # ---- the training loop ------------------------------------------------------------------

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Move the model to the device and convert it for the mode.

        A tuned policy that does not fit this workload (see the class) is replaced first: by
        another tune's answer for this workload, else by ``safe_fallback``, with one warning.

        Args:
            model: the model, on any device.
            optimizer: its optimizer, built on the model's parameters. A conversion that
                replaces parameters (FP8 module swaps) is reflected in it, so the returned
                optimizer trains the new ones.

        Returns:
            ``(model, optimizer)``, or just the model when no optimizer was given.
        """
        import torch

        if not isinstance(model, torch.nn.Module):
            raise MpadviseError(f"setup(model, ...): expected a torch.nn.Module, got {type(model).__name__}")
        wrapper = _distributed_wrapper(model)
        if wrapper is not None:
            # The mode converts the bare model (dtypes, FP8 layers); a wrapper built before that
            # would keep buckets or shards of the old parameters.
            raise MpadviseError(wrapper)
        # Fingerprints describe the user's model, before any mode swaps its modules.
        self._workload = Workload.of(model, optimizer, global_batch=None, script=_script_path(), args=_script_args())
        self.model_signature = self._workload.model
        mismatch = self._workload_mismatch(self.policy)
        if mismatch is not None and not self._apply_other_answer(mismatch, self._workload_mismatch):
            # The answer was measured on another workload: its mode may be unstable or slow
            # for this one. Switch before the conversion below, which is what the mode changes.
            self._fall_back(mismatch.reason(), _args_now(mismatch))
        before = dict(model.named_parameters())
        dtypes = {name: parameter.dtype for name, parameter in before.items()}
        model = model.to(self.device)
        model = self._mode.convert_module(model)
        after = dict(model.named_parameters())
        self._converted = self._converted or model_signature(model) != self.model_signature or any(
            dtypes.get(name) != parameter.dtype for name, parameter in after.items()
        )
        if optimizer is not None:
            retarget_optimizer(optimizer, before, after, self.device)
        for note in self._mode.notes:
            get_logger().info(note)
        first = self.model is None
        self.model, self.optimizer = model, optimizer
        if first and self._observer is not None:
            self._observer.after_setup(self, model)
        return model if optimizer is None else (model, optimizer)

    def _workload_mismatch(self, policy: Policy) -> WorkloadMismatch | None:
        """What changed since ``policy`` was tuned, as far as ``setup()`` can tell."""
        tuned = policy.tuned_on
        # The first model set up is the one trained; a later setup() (a teacher, an EMA copy)
        # cannot switch the mode of the first.
        if tuned is None or self._workload is None or self._mismatch_reported or self.model is not None:
            return None
        # Until micro_batch_size() says which global batch the script trains at, take the
        # tuned one here: micro_batch_size() compares it.
        batch = self._user_batch if self._user_batch is not None else tuned.global_batch
        here = replace(self._workload, global_batch=self._global(batch))
        mismatch = workload_mismatch(tuned, here, model_only=not self._match_workload)
        if mismatch is None or not self._match_workload or tuned.args is None or tuned.args == here.args:
            return mismatch
        # The tune recorded its arguments: name both lists, and judge the rest of the workload
        # as if the arguments were the tuned ones, so what else changed is named too.
        rest = workload_mismatch(tuned, replace(here, args=tuned.args))
        return _with_args(rest, tuned.args, here.args, optimizer_now=here.describe_optimizer(),
                          world_size_now=here.world_size)

    def _batch_mismatch(self, policy: Policy, batch: int) -> WorkloadMismatch | None:
        """A tune's answer tuned at another global batch than the script's ``batch``."""
        tuned_batch = tuned_global_batch(policy)
        if not self._match_workload or self._mismatch_reported or tuned_batch in (None, batch):
            return None
        mismatch = WorkloadMismatch((Difference(GLOBAL_BATCH, str(tuned_batch), str(batch)),))
        # Before setup() the rest of the workload is unknown; the arguments are, where recorded.
        tuned_args, args = None if policy.tuned_on is None else policy.tuned_on.args, _script_args()
        if tuned_args is None or tuned_args == args:
            return mismatch
        return _with_args(mismatch, tuned_args, args)

    def _apply_other_answer(
        self, mismatch: WorkloadMismatch, mismatch_of: Callable[[Policy], WorkloadMismatch | None]
    ) -> bool:
        """Apply the first other answer that ``mismatch_of`` finds no mismatch for, with one
        info line; False when none fits. Those before it are dropped: they do not fit either."""
        for index, (policy, source) in enumerate(self._alternatives):
            if mismatch_of(policy) is None:
                del self._alternatives[: index + 1]
                get_logger().info(
                    f"using {policy.describe()} from {source}, tuned on this workload, rather than "
                    f"{self.policy.describe()} from {self.source}, tuned on another ({mismatch.detail()})"
                )
                self._switch_to(policy, source)
                return True
        self._alternatives.clear()
        return False

    def _fall_back(self, why: str, why_args: tuple[str, ...] | None = None) -> None:
        """Replace the policy by ``safe_fallback`` (the safe default, or the tuned mode where it
        is safer), warning once.

        Only while the model is unconverted (the fallback never converts it: it is never FP8
        and never a pure 16-bit mode). A micro-batch already handed out stays, with its
        accumulation, so the global batch does not change. ``why_args``: this run's arguments,
        when the tune was run with others, so the line names the tune that fits them.
        """
        fallback = safe_fallback(self.policy, self.profile)
        using, source = fallback_words(fallback, self.profile)
        kept = ""
        if self._split is not None and self._split.accum > 1:
            kept = f"; keeping {self._split.describe()}"
        if fallback.describe() == self.policy.describe():
            # The fallback is the tuned policy's own mode with nothing else tuned: the mode
            # stays, and the line says so rather than "fp32 instead of fp32".
            default = safe_default(self.profile).mode
            why_safe = "the safe default here" if fallback.mode == default else f"safer than the safe default {default}"
            instead = f"keeping {fallback.mode} from {self.source}: {why_safe}"
        else:
            instead = f"{using} instead of {self.policy.describe()} from {self.source}"
        get_logger().warning(f"{why}; {_retune_hint(why_args)}; {instead}{kept}")
        self._mismatch_reported = True
        self._switch_to(fallback, f"{source} ({why})")

    def _switch_to(self, policy: Policy, source: str) -> None:
        """Apply ``policy`` in place of the current one (the model not converted yet)."""
        # Switches entered by `with load_policy() as mp:` belong to the old mode: restore them
        # (innermost first) and enter the new mode's in the same nesting.
        depth = len(self._switch_stack)
        while self._switch_stack:
            self._switch_stack.pop().close()
        self.policy = policy
        self.source = source
        self._mode = create_mode(policy, self.device)
        for _ in range(depth):
            self.__enter__()

    def fsdp_mixed_precision(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for this policy: pass it to every ``fully_shard``.

        Call ``setup(model)`` first (it converts the bare model for the mode), then shard, then
        build the optimizer on the sharded parameters. The forward still runs in
        ``autocast()``: for the mixed modes FSDP2 casts the parameters to the same 16-bit dtype
        that autocast computes in, and autocast keeps the ops it lists as fp32 (softmax, the
        losses) in fp32, as in a single process. The mapping is ``fsdp_precision``. For
        fp16-mixed the loss scaler becomes torch's ``ShardedGradScaler`` with the same state,
        so that every rank skips the same steps (each rank sees only its shard's gradients).

        Returns:
            A ``torch.distributed.fsdp.MixedPrecisionPolicy``.
        """
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = fsdp_precision(self.policy)
        self.fsdp = True
        # FSDP2 now holds the mode's dtypes: the mode can no longer be switched.
        self._converted = self._converted or precision.param_dtype is not None
        scaler = getattr(self._mode, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler):
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            if not isinstance(scaler, ShardedGradScaler):
                sharded = ShardedGradScaler(self.device.type)
                sharded.load_state_dict(scaler.state_dict())
                self._mode.scaler = sharded
        return MixedPrecisionPolicy(*_torch_dtypes(precision))

    def to_device(self, *tensors: Any) -> Any:
        """Move tensors (or lists/tuples/dicts of them) to the device and cast them for the mode.

        Integer tensors such as labels keep their dtype. Returns one value for one argument,
        else a tuple.
        """
        moved = tuple(self._move(t) for t in tensors)
        size = _leading_dim(tensors)
        if size is not None:
            self._seen_batches.append(size)
        return moved[0] if len(moved) == 1 else moved

    @property
    def micro_step_samples(self) -> int | None:
        """Samples the current micro-step trains on, for goodput (see ``step_samples``)."""
        if self._split is None:
            return step_samples(self._seen_batches, asked=None, micro=None)
        return step_samples(self._seen_batches, asked=self._user_batch, micro=self._split.micro)

    def _move(self, value: Any) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            return self._mode.convert_input(value.to(self.device, non_blocking=True))
        if isinstance(value, (list, tuple)):
            return type(value)(self._move(v) for v in value)
        if isinstance(value, dict):
            return {k: self._move(v) for k, v in value.items()}
        return value

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward pass (and loss) runs in; restores every switch it set."""
        with self._mode.process_switches(), self._mode.forward_context():
            yield

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Backward, and every ``grad_accum_steps`` micro-batches an optimizer step.

        Scales the loss for the mode (GradScaler) and by ``1 / grad_accum_steps``, clips the
        unscaled gradients if the policy says so, steps the optimizer, updates the scaler and
        zeroes the gradients.

        Returns:
            True when an optimizer step was really taken; False on accumulation micro-steps and
            when the loss scaler skipped the step because gradients overflowed.
        """
        try:
            return self._step(loss, optimizer)
        finally:
            self._seen_batches.clear()  # the next micro-step's batch is what reaches to_device next

    def _step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        import torch

        if not self._fsdp_checked:
            # By the first step every fully_shard has run; once is enough.
            self._fsdp_checked = True
            if self.model is not None:
                refusal = fsdp_policy_refusal(self.model, self.policy)
                if refusal is not None:
                    raise MpadviseError(refusal)
        observer = self._observer
        if observer is not None:
            observer.before_step(self)
        accum = self.grad_accum_steps
        with self._mode.process_switches():
            self._mode.backward(loss / accum if accum > 1 else loss)
            self._micro_step += 1
            if self._micro_step < accum:
                if observer is not None:
                    observer.after_step(self, loss=loss, stepped=False, optimizer_step=False)
                return False
            self._micro_step = 0
            if self.policy.grad_clip_norm is not None or observer is not None:
                self._mode.unscale(optimizer)
            if observer is not None:
                observer.after_backward(self, optimizer)
            if self.policy.grad_clip_norm is not None:
                params = [p for group in optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.policy.grad_clip_norm)
            value = float(loss.detach()) if self.guard.active else 0.0  # the loss value's one sync
            # A non-finite loss under fallback is never applied: a scaler skips it itself.
            withheld = self.guard.setting == "fallback" and not math.isfinite(value) and self.loss_scale() is None
            stepped = False if withheld else self._mode.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if not stepped:
            self.skipped_steps += 1
        if observer is not None:
            observer.after_step(self, loss=loss, stepped=stepped, optimizer_step=True)
        if self.guard.active:
            tripped = self.guard.observe(self.optimizer_steps, loss=value, applied=stepped or withheld,
                                         loss_scale=self.loss_scale())
            if tripped is not None:
                self._guard_tripped(*tripped)
        return stepped

    def _guard_tripped(self, signal: str, onset: int, detail: str) -> None:
        """Act on a tripped guard: warn once, or move in place to ``guard_fallback``'s policy."""
        target = guard_fallback(self.policy, self.profile)
        old = self.policy.mode
        action = "warned"
        if self.guard.setting == "fallback" and target is not None:
            # FP8 layers and framework-owned precision cannot be taken back in place.
            in_place = self.in_place and mode_facts(old).fp8_library is None
            action = "fell back" if in_place else "restart needed"
        event = GuardEvent(signal, onset, self.optimizer_steps, old, None if target is None else target.mode,
                           action, detail)
        if action == "fell back" and target is not None:
            if self.model is not None and mode_facts(old).weights != "fp32":
                upcast_in_place(self.model, self.optimizer)
            self._switch_to(target, f"{target.mode}, the guard's fallback from {old} ({signal})")
            self.guard.rearm()
        self.guard.record(event)
        get_logger().warning(event.line())
        if self.on_guard_event is not None:
            self.on_guard_event(event)

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The precision state a checkpoint needs: loss scaler, FP8 state, accumulation position."""
        if self._micro_step:
            get_logger().warning(
                f"state_dict() taken after {self._micro_step} of {self.grad_accum_steps} accumulated "
                "micro-batches: their gradients are not in a checkpoint; save after a step() that returned True"
            )
        return {
            "mode": self.policy.mode,
            "micro_step": self._micro_step,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "mode_state": self._mode.state_dict(),
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, so a resumed run continues exactly."""
        if not isinstance(state, dict) or "mode" not in state:
            raise MpadviseError("load_state_dict: expected the dict returned by state_dict()")
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if state["mode"] != self.policy.mode:
            get_logger().warning(
                f"checkpoint precision state is from mode {state['mode']!r}, this run uses "
                f"{self.policy.mode!r}: its loss-scale/FP8 state is not restored"
            )
            return
        self._micro_step = int(state.get("micro_step", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._mode.load_state_dict(state.get("mode_state", {}))

    def __enter__(self) -> AppliedPolicy:
        stack = contextlib.ExitStack()
        stack.enter_context(self._mode.process_switches())
        self._switch_stack.append(stack)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._switch_stack.pop().close()

    def __repr__(self) -> str:
        return f"AppliedPolicy({self.policy.describe()!r}, device={str(self.device)!r}, source={self.source!r})"
