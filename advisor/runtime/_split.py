"""How a script's batch is fed under a policy: micro-batches, accumulation, samples per step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from policies import Policy


@dataclass(frozen=True)
class BatchSplit:
    """Micro-batches of ``micro`` samples, ``accum`` per optimizer step, and a line for the log."""

    micro: int
    accum: int
    note: str = ""
    warning: bool = False

    def describe(self) -> str:
        """``"micro-batch 16 x 4 (global batch 64)"``."""
        if self.accum == 1:
            return f"micro-batch {self.micro}"
        return f"micro-batch {self.micro} x {self.accum} (global batch {self.micro * self.accum})"


def tuned_global_batch(policy: Policy) -> int | None:
    """The script's batch per process a tuned policy was measured at; ``None`` when unknown."""
    tuned = policy.tuned_on
    if tuned is None:
        return None
    if tuned.global_batch is not None:
        return tuned.global_batch
    # Older tuned policies split the script's batch exactly (the search only tries divisors),
    # so micro x accumulation was the global batch they were tuned at. Accumulation 1 with a
    # micro-batch was a --scale-batch winner: its tuned batch is unknown.
    accum, micro = policy.grad_accum_steps, policy.micro_batch_size
    if tuned.hardware_fingerprint and micro is not None and accum is not None and accum > 1:
        return micro * accum
    return None


def batch_split(policy: Policy, batch: int) -> BatchSplit:
    """How ``policy`` feeds a script whose own (global) batch is ``batch``. A tuned policy keeps
    the script's batch, split anew (with a warning) when it is not the tuned one; a hand-written
    policy does what it says."""
    tuned_batch = tuned_global_batch(policy)
    micro = policy.micro_batch_size
    if tuned_batch is None:
        return _stated_split(policy, batch)
    if batch == tuned_batch:
        if micro is None or micro == batch:
            return BatchSplit(batch, 1)
        if micro > batch:
            # A --scale-batch winner: changing the global batch was opted into at tuning time.
            return BatchSplit(micro, 1, f"global batch changes from {batch} to {micro} (policy micro-batch {micro}, tuned with --scale-batch)")
        if batch % micro == 0:
            return BatchSplit(micro, batch // micro)
    # Split the script's batch exactly, at most as large as the micro-batch that was measured
    # (so it still fits in memory).
    size = next(size for size in range(min(micro or batch, batch), 0, -1) if batch % size == 0)
    split = BatchSplit(size, batch // size)
    if batch == tuned_batch:
        note = f"micro-batch {micro} does not divide the batch {batch}: using {split.describe()}"
        return replace(split, note=note)
    note = (
        f"batch {batch} differs from the global batch {tuned_batch} the policy was tuned at: keeping the "
        f"global batch {batch} ({split.describe()}); run `mpadvise tune` again to tune for it"
    )
    return replace(split, note=note, warning=True)


def _stated_split(policy: Policy, batch: int) -> BatchSplit:
    """A hand-written policy's split: what it states, else accumulation up to ``batch``."""
    micro = policy.micro_batch_size or batch
    if policy.grad_accum_steps is not None:
        split = BatchSplit(micro, policy.grad_accum_steps)
        if micro * split.accum != batch:
            stated = f"micro-batch {micro} x {split.accum}" if split.accum > 1 else f"micro-batch {micro}"
            return replace(split, note=f"global batch changes from {batch} to {micro * split.accum} (policy {stated})")
        return split
    if policy.micro_batch_size is None or micro >= batch:
        note = f"global batch changes from {batch} to {micro} (policy micro-batch {micro})" if micro > batch else ""
        return BatchSplit(micro, 1, note)
    accum = batch // micro
    if batch % micro:
        note = (
            f"batch {batch} is not a multiple of micro-batch {micro}: accumulating {accum} "
            f"micro-batches, so the global batch becomes {micro * accum}"
        )
        return BatchSplit(micro, accum, note, warning=True)
    return BatchSplit(micro, accum)


def step_samples(seen: list[int], *, asked: int | None, micro: int | None) -> int | None:
    """How many samples one micro-step trained on: the largest leading dimension ``seen`` by
    ``to_device`` since the last step, else ``micro``. One larger than the batch the script
    asked for (or ``micro``) is a dataset moved once, not a batch, and does not count."""
    limit = None if asked is None else max(asked, micro or 0)
    batches = [size for size in seen if limit is None or size <= limit]
    return max(batches) if batches else micro


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
