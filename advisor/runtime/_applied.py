"""AppliedPolicy: the one object a training script uses to train under a Policy, and its
``step()`` (backward, accumulation, unscale, clip, the optimizer step, the guard's look)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from advisor._log import get_logger
from advisor.runtime import _match, _setup
from advisor.runtime._guard import Guard, GuardEvent
from advisor.runtime._split import _leading_dim, step_samples
from advisor.runtime._switch import guard_tripped
from policies import Policy, create_mode
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

    As a context manager it sets the mode's process-wide switches (TF32) and restores them on
    exit. A tuned policy that does not fit the workload (``setup()``, ``micro_batch_size()``) is
    replaced by another answer tuned on it, else by ``safe_fallback``, in one line naming why."""

    def __init__(self, policy: Policy, *, profile: HardwareProfile, source: str,
                 device: str | torch.device | None = None, observer: StepObserver | None = None,
                 match_workload: bool = False, alternatives: Sequence[tuple[Policy, str]] = (),
                 guard: Guard | None = None, on_guard_event: Callable[[GuardEvent], None] | None = None) -> None:
        """``match_workload``: check the whole workload (a tune's answer), not only the model,
        trying ``alternatives`` (other answers for this script) in order where it does not fit."""
        import torch

        self.policy, self.profile, self.source = policy, profile, source
        self.device = torch.device(rank_device(device, profile.device, os.environ))
        self._mode = create_mode(policy, self.device)
        self._observer = observer
        self._check = _match.WorkloadCheck(match_workload, list(alternatives) if match_workload else [])
        self._micro_done = 0  # micro-batches of the current optimizer step done
        self._seen_batches: list[int] = []  # leading dimensions to_device() saw since the last step
        self._fsdp_checked = False
        # Whether the model's dtypes or modules were changed for the mode (setup(), FSDP2):
        # after that the mode can no longer be switched.
        self._converted = False
        self._switch_stack: list[contextlib.ExitStack] = []
        self.optimizer_steps = self.skipped_steps = 0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.model_signature: str | None = None
        self.fsdp = False  # whether the script asked for fsdp_mixed_precision()
        self.guard = guard if guard is not None else Guard("off")
        self.on_guard_event = on_guard_event

    mode = property(lambda self: self.policy.mode, doc="The mode in force.")
    notes = property(lambda self: list(self._mode.notes), doc="What the mode said converting the model.")
    user_batch = property(lambda self: self._check.user_batch, doc="The micro_batch_size() argument.")
    grad_accum_steps = property(_match.grad_accum_steps)
    world_size = property(_match.world_size)
    global_batch = property(_match.global_batch)
    workload_fingerprint = property(_match.workload_fingerprint)

    @property
    def micro_step_samples(self) -> int | None:
        """Samples the current micro-step trains on, for goodput (see ``step_samples``)."""
        split, asked = self._check.split, self._check.user_batch
        if split is None:
            return step_samples(self._seen_batches, asked=None, micro=None)
        return step_samples(self._seen_batches, asked=asked, micro=split.micro)

    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` where the mode does not scale the loss."""
        return self._mode.loss_scale()

    def micro_batch_size(self, default: int) -> int:
        """The batch size a DataLoader should use for the script's own (global) batch ``default``;
        ``step()`` accumulates the rest. The first call sets the training batch; a later call
        with another batch (an evaluation loader) gets ``default`` back."""
        if isinstance(default, bool) or not isinstance(default, int) or default <= 0:
            raise MpadviseError(f"micro_batch_size(default): {default!r} is not a batch size; expected a positive integer")
        split = self._check.split
        if split is not None and self._check.user_batch is not None:
            return _match.later_micro_batch(self._check, default, split)
        return _match.first_micro_batch(self, default)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Move and convert the model for the mode; ``(model, optimizer)``, or the model alone."""
        return _setup.setup_model(self, model, optimizer)

    def fsdp_mixed_precision(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for this policy: ``setup(model)`` first, pass it to every
        ``fully_shard``, then build the optimizer on the sharded parameters. For fp16-mixed the
        loss scaler becomes a ``ShardedGradScaler``, so that every rank skips the same steps."""
        return _setup.fsdp_mixed_precision(self)

    def to_device(self, *tensors: Any) -> Any:
        """Move tensors (or lists/tuples/dicts of them) to the device, cast for the mode (integer
        tensors keep their dtype); one value for one argument, else a tuple."""
        moved = tuple(move_to(t, self.device, self._mode.convert_input) for t in tensors)
        size = _leading_dim(tensors)
        if size is not None:
            self._seen_batches.append(size)
        return moved[0] if len(moved) == 1 else moved

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward pass (and loss) runs in; restores every switch it set."""
        with self._mode.process_switches(), self._mode.forward_context():
            yield

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Backward, and every ``grad_accum_steps`` micro-batches an optimizer step; True when taken."""
        try:
            return train_step(self, loss, optimizer)
        finally:
            self._seen_batches.clear()  # the next micro-step's batch is what reaches to_device next

    def state_dict(self) -> dict[str, Any]:
        """The precision state a checkpoint needs: loss scaler, FP8 state, accumulation position."""
        done = self._micro_done
        if done:
            get_logger().warning(
                f"state_dict() taken after {done} of {self.grad_accum_steps} accumulated "
                "micro-batches: their gradients are not in a checkpoint; save after a step() that returned True"
            )
        return {"mode": self.policy.mode, "micro_step": done, "optimizer_steps": self.optimizer_steps,
                "skipped_steps": self.skipped_steps, "mode_state": self._mode.state_dict(),
                "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; from another mode, only the guard (one warning)."""
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
        self._micro_done = int(state.get("micro_step", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._mode.load_state_dict(state.get("mode_state", {}))

    def __enter__(self) -> AppliedPolicy:
        self._switch_stack.append(contextlib.ExitStack())
        self._switch_stack[-1].enter_context(self._mode.process_switches())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._switch_stack.pop().close()

    def __repr__(self) -> str:
        return f"AppliedPolicy({self.policy.describe()!r}, device={str(self.device)!r}, source={self.source!r})"


def rank_device(device: str | torch.device | None, profile_device: str, env: Mapping[str, str]) -> str | torch.device:
    """``device`` when named with an index; under torchrun on a GPU ``cuda:LOCAL_RANK``."""
    if device is not None and str(device) != "cuda":
        return device
    chosen = device if device is not None else profile_device
    local_rank = env.get("LOCAL_RANK", "")
    if str(chosen).startswith("cuda") and local_rank.isdigit():
        return f"cuda:{int(local_rank)}"
    return chosen


def move_to(value: Any, device: torch.device, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (a tensor, or lists/tuples/dicts of them) on ``device``, through ``convert``."""
    import torch

    if isinstance(value, torch.Tensor):
        return convert(value.to(device, non_blocking=True))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device, convert) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device, convert) for k, v in value.items()}
    return value


def train_step(applied: AppliedPolicy, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
    """``step()``'s work; the loss is read back (a sync) only with the guard on."""
    import torch

    if not applied._fsdp_checked:
        # By the first step every fully_shard has run; once is enough.
        applied._fsdp_checked = True
        if applied.model is not None:
            refusal = _setup.fsdp_policy_refusal(applied.model, applied.policy)
            if refusal is not None:
                raise MpadviseError(refusal)
    observer, mode, policy, guard = applied._observer, applied._mode, applied.policy, applied.guard
    if observer is not None:
        observer.before_step(applied)
    accum = applied.grad_accum_steps
    with mode.process_switches():
        mode.backward(loss / accum if accum > 1 else loss)
        applied._micro_done += 1
        if applied._micro_done < accum:
            if observer is not None:
                observer.after_step(applied, loss=loss, stepped=False, optimizer_step=False)
            return False
        applied._micro_done = 0
        if policy.grad_clip_norm is not None or observer is not None:
            mode.unscale(optimizer)
        if observer is not None:
            observer.after_backward(applied, optimizer)
        if policy.grad_clip_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, policy.grad_clip_norm)
        value = float(loss.detach()) if guard.active else 0.0  # the loss value's one sync
        # A non-finite loss under fallback is never applied: a scaler skips it itself.
        withheld = guard.setting == "fallback" and not math.isfinite(value) and mode.loss_scale() is None
        if guard.active:  # a sample of the 16-bit weights, every few steps, to see updates lost
            guard.probe.before(applied.optimizer_steps + 1, (p for g in optimizer.param_groups for p in g["params"]))
        stepped = False if withheld else mode.optimizer_step(optimizer)
        lost = guard.probe.lost() if guard.active else None
        optimizer.zero_grad(set_to_none=True)
    applied.optimizer_steps += 1
    if not stepped:
        applied.skipped_steps += 1
    if observer is not None:
        observer.after_step(applied, loss=loss, stepped=stepped, optimizer_step=True)
    if guard.active:
        tripped = guard.observe(applied.optimizer_steps, loss=value, applied=stepped or withheld,
                                # The scale falls only on a skipped step: reading it then spares the
                                # applied steps a second device sync.
                                loss_scale=None if stepped else applied.loss_scale(), lost=lost if stepped else None)
        if tripped is not None:
            guard_tripped(applied, *tripped)
    return stepped
