"""AppliedPolicy: the one object a training script uses to train under a Policy.

Its jobs live beside it: the workload check and batch split (``_match``), setup and FSDP2
(``_setup``), the optimizer step (``_step``), switching policy in place, for the fallback and
the guard (``_switch``), and checkpoints (``_checkpoint``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from advisor.runtime import _checkpoint, _match, _setup
from advisor.runtime._device import move_to, rank_device
from advisor.runtime._guard import Guard, GuardEvent
from advisor.runtime._split import _leading_dim
from advisor.runtime._step import MicroSteps, micro_step_samples, train_step
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

    Made by ``advisor.load_policy()``. Also a context manager: entering sets the mode's
    process-wide switches (TF32 matmul precision), leaving restores them exactly.

    A tuned policy is checked against the workload it was tuned on once the workload is known
    (``setup()``: model, optimizer, script; ``micro_batch_size()``: the global batch). A tune's
    answer must match all of it; a config file the user named, or one written by hand, the
    model's structure. The first other answer tuned on this workload applies instead (one info
    line); failing that ``safe_fallback`` does, with one warning that names what changed, and
    the global batch stays what ``micro_batch_size()`` answered.

    Attributes:
        policy: the Policy in force; source: where it came from (``"safe default"``...).
        device: the torch device training runs on; profile: the hardware profile of that device.
        guard: the ``Guard`` watching the optimizer steps; on_guard_event: receives its events.
        optimizer_steps, skipped_steps: optimizer steps taken, and of those the ones not applied.
    """

    def __init__(self, policy: Policy, *, profile: HardwareProfile, source: str,
                 device: str | torch.device | None = None, observer: StepObserver | None = None,
                 match_workload: bool = False, alternatives: Sequence[tuple[Policy, str]] = (),
                 guard: Guard | None = None, on_guard_event: Callable[[GuardEvent], None] | None = None) -> None:
        """Apply ``policy`` on ``profile``'s device (``device`` overrides it); ``source`` names
        it in log lines; ``observer`` receives what ``step()`` does (the trial recorder).

        Args:
            match_workload: apply a tuned policy only to the whole workload it was tuned on
                (a tune's answer); otherwise only the model's structure is checked.
            alternatives: with ``match_workload``, the other tunes' answers for this script
                (``(policy, source)``, in order), tried when ``policy`` does not fit.
            guard: watches the optimizer steps; none: off.
        """
        import torch

        self.policy, self.profile, self.source = policy, profile, source
        # Under torchrun each process trains on its own GPU (LOCAL_RANK), unless one was named.
        self.device = torch.device(rank_device(device, profile.device, os.environ))
        self._mode = create_mode(policy, self.device)
        self._observer = observer
        self._check = _match.WorkloadCheck(match_workload, list(alternatives) if match_workload else [])
        self._micro = MicroSteps()
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
    micro_step_samples = property(micro_step_samples)

    def loss_scale(self) -> float | None:
        """The current loss scale, or ``None`` where the mode does not scale the loss."""
        return self._mode.loss_scale()

    def micro_batch_size(self, default: int) -> int:
        """The batch size a DataLoader should use.

        Args:
            default: the script's own batch size, i.e. its global batch. With a policy that
                splits it (micro-batch 64 of a global 256), ``step()`` accumulates 256 // 64
                micro-batches per optimizer step so the optimisation stays the same. The first
                call sets the training batch; a later one with another batch (an evaluation
                loader) gets ``default`` back unchanged.

        Returns:
            The micro-batch size; ``default`` when the policy sets none, and on a later call
            with another batch.
        """
        if isinstance(default, bool) or not isinstance(default, int) or default <= 0:
            raise MpadviseError(f"micro_batch_size(default): {default!r} is not a batch size; expected a positive integer")
        split = self._check.split
        if split is not None and self._check.user_batch is not None:
            return _match.later_micro_batch(self._check, default, split)
        return _match.first_micro_batch(self, default)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Move the model to the device and convert it for the mode; returns ``(model,
        optimizer)``, or the model alone. A tuned policy that does not fit this workload is
        replaced first (see the class). A conversion that replaces parameters (FP8 module
        swaps) is reflected in ``optimizer``, so that it trains the new ones."""
        return _setup.setup_model(self, model, optimizer)

    def fsdp_mixed_precision(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for this policy (``fsdp_precision``): call ``setup(model)``
        first, pass it to every ``fully_shard``, then build the optimizer on the sharded
        parameters; the forward still runs in ``autocast()``. For fp16-mixed the loss scaler
        becomes a ``ShardedGradScaler``, so that every rank skips the same steps."""
        return _setup.fsdp_mixed_precision(self)

    def to_device(self, *tensors: Any) -> Any:
        """Move tensors (or lists/tuples/dicts of them) to the device and cast them for the mode;
        integer tensors keep their dtype. One value for one argument, else a tuple."""
        moved = tuple(move_to(t, self.device, self._mode.convert_input) for t in tensors)
        size = _leading_dim(tensors)
        if size is not None:
            self._micro.seen_batches.append(size)
        return moved[0] if len(moved) == 1 else moved

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The context the forward pass (and loss) runs in; restores every switch it set."""
        with self._mode.process_switches(), self._mode.forward_context():
            yield

    def step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Backward (the loss scaled for the mode and by ``1 / grad_accum_steps``), and every
        ``grad_accum_steps`` micro-batches: unscale, clip if the policy says so, step, update
        the scaler, zero the gradients. True when an optimizer step was really taken."""
        try:
            return train_step(self, loss, optimizer)
        finally:
            self._micro.seen_batches.clear()  # the next micro-step's batch is what reaches to_device next

    def state_dict(self) -> dict[str, Any]:
        """The precision state a checkpoint needs: loss scaler, FP8 state, accumulation position."""
        return _checkpoint.precision_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, so a resumed run continues exactly."""
        _checkpoint.load_precision_state(self, state)

    def __enter__(self) -> AppliedPolicy:
        stack = contextlib.ExitStack()
        stack.enter_context(self._mode.process_switches())
        self._switch_stack.append(stack)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._switch_stack.pop().close()

    def __repr__(self) -> str:
        return f"AppliedPolicy({self.policy.describe()!r}, device={str(self.device)!r}, source={self.source!r})"
