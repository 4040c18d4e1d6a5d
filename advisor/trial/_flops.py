"""The FLOPs of one whole optimizer step of a trial: counted by torch's FlopCounterMode, or
estimated for a model fed token ids where counting fails."""

from __future__ import annotations

from typing import Any

from ._schema import TrialSpec

# The optimizer step whose FLOPs are counted (``spec.count_flops``): the second, so that the
# first step's compilation, autotuning and allocator growth are not inside the count. It must
# be a warm-up step: counting slows the step it counts, and no measured step may carry that.
FLOPS_STEP = 2
# 2 FLOPs per multiply-add, the backward twice the forward, per trainable parameter and token.
FLOPS_ESTIMATE = "6 x parameters x tokens"


class StepFlops:
    """Counts the FLOPs of optimizer step ``FLOPS_STEP``, all its micro-batches: torch's
    ``FlopCounterMode`` is entered at the end of the step before and left at the end of the
    counted one, whatever framework runs the loop."""

    step = FLOPS_STEP

    def __init__(self) -> None:
        self.flops: int | None = None
        self.error: str | None = None
        self.tokens = 0
        self.integer_input: bool | None = None
        self.parameters = 0
        self._model: Any = None
        self._counter: Any = None
        self._counting = self._done = False

    @classmethod
    def for_spec(cls, spec: TrialSpec) -> StepFlops | None:
        return cls() if spec.count_flops and spec.warmup_steps >= FLOPS_STEP else None

    @staticmethod
    def note_for(spec: TrialSpec, flops: StepFlops | None) -> str | None:
        """A sentence for the trial's report where FLOPs were asked for and not counted."""
        if not spec.count_flops:
            return None
        if flops is None:
            return (f"FLOPs per step not counted: the warm-up has {spec.warmup_steps} steps, and the counted step "
                    f"(step {FLOPS_STEP}) must be one of them; run with --warmup {FLOPS_STEP} or more")
        if not flops._done or (flops.flops and flops.error is None):
            return None
        why = flops.error or "torch's FLOP counter counted nothing in the step"
        if flops.result()[1] == FLOPS_ESTIMATE:
            return f"FLOPs per step estimated as {FLOPS_ESTIMATE} ({flops.tokens} tokens): counting failed: {why}"
        return f"FLOPs per step not known: counting failed ({why}), and the model is not fed token ids"

    def watch(self, model: Any) -> None:
        """Count the token ids the first ``model``'s training forwards take in the counted step."""
        if self._model is not None or not hasattr(model, "register_forward_pre_hook"):
            return
        self._model = model

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            import torch

            if not torch.is_grad_enabled():
                return  # an evaluation forward, not the training step's
            first = _first_tensor(args, kwargs)
            if first is None:
                return
            integer = not (first.is_floating_point() or first.is_complex()) and first.dtype != torch.bool
            if self.integer_input is None:
                self.integer_input = integer
            if self._counting and integer:
                self.tokens += first.numel()

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def start(self) -> None:
        if self._counting or self._done:
            return
        self._counting = True  # tokens are read even where the counter cannot be entered
        try:
            self._counter = _guarded_flop_counter()
            self._counter.__enter__()
        except Exception as exc:  # counting is a measurement of the trial, never its failure
            self._counter, self.error = None, f"{type(exc).__name__}: {exc}"

    def stop(self, *, discard: bool = False) -> None:
        """Leave the counter (``discard``: the trial ended inside the step)."""
        if not self._counting:
            return
        self._counting, self._done = False, not discard
        counter, self._counter = self._counter, None
        if counter is not None:
            try:
                counter.__exit__(None, None, None)
                self.flops = int(counter.get_total_flops())
            except Exception as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"
            self.error = self.error or counter.failure
        if self._model is not None:
            self.parameters = sum(p.numel() for p in self._model.parameters() if p.requires_grad)

    def result(self) -> tuple[float | None, str | None]:
        """``(flops_per_step, flops_basis)``: counted, estimated, or ``(None, None)``."""
        if not self._done:
            return None, None
        if self.flops and self.error is None:
            return float(self.flops), "counted"
        if self.integer_input and self.tokens and self.parameters:
            return 6.0 * self.parameters * self.tokens, FLOPS_ESTIMATE
        return None, None


def _first_tensor(args: Any, kwargs: Any) -> Any:
    """A forward's first positional tensor, else ``input_ids``, else its first keyword tensor."""
    import torch

    values = [*args, kwargs.get("input_ids"), *kwargs.values()]
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _guarded_flop_counter() -> Any:
    """torch's FlopCounterMode (quiet) that keeps an error of its counting as ``failure``."""
    from torch.utils.flop_counter import FlopCounterMode

    class GuardedFlopCounter(FlopCounterMode):
        failure: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            try:
                return super()._count_flops(func_packet, out, args, kwargs)
            except Exception as exc:
                if self.failure is None:
                    self.failure = f"counting {func_packet} raised {type(exc).__name__}: {exc}"
                return out

    return GuardedFlopCounter(display=False)
