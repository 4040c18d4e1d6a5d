"""AppliedPolicy: the one object a training script uses to train under a Policy."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from advisor import _paths
from advisor._log import get_logger
from advisor.runtime._retarget import retarget_optimizer
from advisor.runtime._workload import model_signature, workload_fingerprint
from policies import Policy, create_mode, safe_default
from probes import MpadviseError

if TYPE_CHECKING:
    import torch

    from probes import HardwareProfile


class StepObserver:
    """Receives what ``AppliedPolicy.step`` did; the trial recorder implements it."""

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
    ) -> None:
        import torch

        self.policy = policy
        self.profile = profile
        self.source = source
        self.device = torch.device(device if device is not None else profile.device)
        self._mode = create_mode(policy, self.device)
        self._observer = observer
        self._user_batch: int | None = None
        self._micro_step = 0
        self._switch_stack: list[contextlib.ExitStack] = []
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_batch_size: int | None = None
        self.model_signature: str | None = None
        self._workload_base: str | None = None

    # ---- what the policy says ---------------------------------------------------------------

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

        Args:
            default: the script's own batch size, i.e. its global batch. With a policy that
                splits it (micro-batch 64 of a global 256), ``step()`` accumulates 256 // 64
                micro-batches per optimizer step so the optimisation stays the same.

        Returns:
            The policy's micro-batch size, or ``default`` when the policy sets none.
        """
        if isinstance(default, bool) or not isinstance(default, int) or default <= 0:
            raise MpadviseError(f"micro_batch_size(default): {default!r} is not a batch size; expected a positive integer")
        self._user_batch = default
        micro = self.policy.micro_batch_size or default
        if self.policy.grad_accum_steps is None and self.policy.micro_batch_size is not None:
            if micro > default:
                get_logger().info(f"global batch changes from {default} to {micro} (policy micro-batch {micro})")
            elif default % micro:
                accum = default // micro
                get_logger().warning(
                    f"batch {default} is not a multiple of micro-batch {micro}: accumulating {accum} "
                    f"micro-batches, so the global batch becomes {micro * accum}"
                )
        return micro

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step (1 unless the policy splits the script's batch)."""
        if self.policy.grad_accum_steps is not None:
            return self.policy.grad_accum_steps
        micro = self.policy.micro_batch_size
        if micro is None or self._user_batch is None or micro >= self._user_batch:
            return 1
        return max(1, self._user_batch // micro)

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step, once ``micro_batch_size()`` has been called."""
        if self._user_batch is None:
            return None
        return (self.policy.micro_batch_size or self._user_batch) * self.grad_accum_steps

    @property
    def workload_fingerprint(self) -> str | None:
        """Model structure, optimizer, global batch and script: the cache key of this workload.

        Known after ``setup()``; the global batch joins once ``micro_batch_size()`` was called.
        """
        if self._workload_base is None:
            return None
        return hashlib.sha256(f"{self._workload_base}|global_batch={self.global_batch}".encode()).hexdigest()[:16]

    @property
    def user_batch(self) -> int | None:
        """The batch size the script asked for (the argument of ``micro_batch_size``)."""
        return self._user_batch

    # ---- the training loop ------------------------------------------------------------------

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Move the model to the device and convert it for the mode.

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
        # Fingerprints describe the user's model, before any mode swaps its modules.
        self.model_signature = model_signature(model)
        self._workload_base = workload_fingerprint(model, optimizer, global_batch=None, script=_script_path())
        tuned = self.policy.tuned_on
        if tuned is not None and tuned.model_signature and tuned.model_signature != self.model_signature:
            # The answer was measured on another model: its mode may be unstable or slow for
            # this one. Switch before the conversion below, which is what the mode changes.
            self._use_safe_default("model changed since tuning (structure differs from what was tuned)")
        before = dict(model.named_parameters())
        model = model.to(self.device)
        model = self._mode.convert_module(model)
        after = dict(model.named_parameters())
        if optimizer is not None:
            retarget_optimizer(optimizer, before, after, self.device)
        for note in self._mode.notes:
            get_logger().info(note)
        self.model, self.optimizer = model, optimizer
        return model if optimizer is None else (model, optimizer)

    def _use_safe_default(self, why: str) -> None:
        """Replace the policy by the hardware's safe default, warning once; before conversion only."""
        default = safe_default(self.profile)
        get_logger().warning(
            f"{why}; run `mpadvise tune` again; using the safe default {default.mode} "
            f"instead of {self.policy.describe()} from {self.source}"
        )
        # Switches entered by `with load_policy() as mp:` belong to the old mode: restore them
        # (innermost first) and enter the new mode's in the same nesting.
        depth = len(self._switch_stack)
        while self._switch_stack:
            self._switch_stack.pop().close()
        self.policy = default
        self.source = f"safe default for {self.profile.name} ({why})"
        self._mode = create_mode(default, self.device)
        for _ in range(depth):
            self.__enter__()

    def to_device(self, *tensors: Any) -> Any:
        """Move tensors (or lists/tuples/dicts of them) to the device and cast them for the mode.

        Integer tensors such as labels keep their dtype. Returns one value for one argument,
        else a tuple.
        """
        moved = tuple(self._move(t) for t in tensors)
        size = _leading_dim(tensors)
        if size is not None:
            self.last_batch_size = size  # samples per micro-batch, for throughput
        return moved[0] if len(moved) == 1 else moved

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
        import torch

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
            stepped = self._mode.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if not stepped:
            self.skipped_steps += 1
        if observer is not None:
            observer.after_step(self, loss=loss, stepped=stepped, optimizer_step=True)
        return stepped

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, so a resumed run continues exactly."""
        if not isinstance(state, dict) or "mode" not in state:
            raise MpadviseError("load_state_dict: expected the dict returned by state_dict()")
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

    # ---- process-wide switches --------------------------------------------------------------

    def __enter__(self) -> AppliedPolicy:
        stack = contextlib.ExitStack()
        stack.enter_context(self._mode.process_switches())
        self._switch_stack.append(stack)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._switch_stack.pop().close()

    def __repr__(self) -> str:
        return f"AppliedPolicy({self.policy.describe()!r}, device={str(self.device)!r}, source={self.source!r})"


def _script_path() -> str | None:
    script = _paths.current_script()
    return str(script) if script is not None else None


def _leading_dim(values: Any) -> int | None:
    """The batch dimension of the first tensor (depth first) with at least one dimension."""
    for value in values.values() if isinstance(values, dict) else values:
        if hasattr(value, "dim") and hasattr(value, "shape"):
            if value.dim() > 0:
                return int(value.shape[0])
        elif isinstance(value, (list, tuple, dict)):
            found = _leading_dim(value)
            if found is not None:
                return found
    return None
