"""What a trial reads of the optimizer that fp16 may lose: the sampled gradient underflow
(``underflow_counts``, read once at the end) and the smallest ``eps`` (``optimizer_eps``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# fp16's smallest subnormal value. A gradient whose scaled magnitude |g| * loss_scale is below
# it rounds to zero in an fp16 backward: the loss Micikevicius et al. (2018) measured (about 5%
# of weight gradients below 2^-24 without scaling) and StabilityThresholds.max_underflow_fraction
# bounds.
FP16_MIN_SUBNORMAL = 2.0**-24
# fp16's smallest normal value. Below it fp16 holds fewer significant bits, down to none at
# FP16_MIN_SUBNORMAL: a gradient whose values mostly lie there sits at the edge of what fp16
# can hold, and its zeros are values that fell off it (underflow_counts).
FP16_MIN_NORMAL = 2.0**-14
# Gradient values sampled on a sampled step, spread over all gradients in proportion to their
# size, so that each tensor weighs what its share of the values weighs. 2^16 values put the
# sampling error of a fraction near 5% below 0.1 percentage points.
UNDERFLOW_SAMPLE = 2**16
# The underflow is sampled on every UNDERFLOW_EVERY-th optimizer step (from step 0): it moves
# with the loss scale, which changes over tens of steps, and sampling costs device work. With
# the default 45-step trial that is 12 samples, 7 of them after the 16 calibration steps.
UNDERFLOW_EVERY = 4


def optimizer_eps(optimizer: Any) -> float | None:
    """The smallest ``eps`` among the optimizer's param groups that compute in their own dtype
    (a ``fused`` group computes in fp32), or ``None`` where no group has a numeric one.

    A verdict reads it: an eps that rounds to zero in fp16 makes pure fp16's Adam divide by zero.
    """
    values = [group["eps"] for group in getattr(optimizer, "param_groups", ())
              if isinstance(group.get("eps"), (int, float)) and not isinstance(group.get("eps"), bool)
              and not group.get("fused")]
    return float(min(values)) if values else None


def gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's gradients; under FSDP2 this rank's shards of them (a DTensor's local
    part: sampling the whole tensor would gather it from every rank)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return [g for g in local if g.layout == torch.strided]  # sparse gradients have no flat view


def underflow_counts(grads: list[torch.Tensor], *, scale: float, budget: int = UNDERFLOW_SAMPLE) -> torch.Tensor | None:
    """Count sampled gradient values that an fp16 backward lost, or would lose, to underflow.

    The sample is systematic over all gradients laid end to end (every ``stride``-th value), so
    each tensor contributes in proportion to its size. Non-finite values (a step the scaler
    skips) are left out. Two kinds of value are lost:

    * would flush: nonzero, but below fp16's smallest subnormal 2^-24 once multiplied by the
      loss scale. Only a gradient held in more precision than fp16 shows these (a layer that
      runs in fp32 under autocast); it would lose them in fp16.
    * already flushed: zeros. A gradient that came through an fp16 operation (every autocast
      matmul, every layer of fp16-true) holds the values that flushed as exact zeros, so with
      99.9% of such a gradient flushed, the nonzero values alone showed 0% lost. But exact
      zeros are also what fp32 computes for a dead ReLU unit, an embedding row not in the
      batch or an input feature that is zero, which no loss scale changes. The two are told
      apart per gradient tensor: a flush takes the values below 2^-24, so where a tensor's
      nonzero values mostly lie in fp16's subnormal range (below 2^-14, where it keeps fewer
      significant bits), the tensor sits at fp16's edge and its zeros count as flushed; where
      they mostly lie in fp16's normal range, its zeros are structural and are left out, as
      exact zeros that fp32 would produce too. A tensor with no nonzero value sampled counts as
      flushed only when no tensor shows values in the normal range (the whole gradient
      flushed); beside healthy tensors it is more likely a sparse one (an embedding table).

    The verdict uses both: their sum over the values counted (the nonzero ones and the zeros
    counted as flushed), since both are gradient that an fp16 backward at this scale does not
    deliver. The median rule undercounts a partial flush of a tensor whose values spread over
    many binades (a few percent at most while its median stays above 2^-14) and overcounts a
    tensor at fp16's edge that also has structural zeros; both err by less than the underflow
    limit's 5% in the cases that matter.

    Args:
        grads: the unscaled gradients, on one device.
        scale: the loss scale the backward ran with (1.0 without scaling).
        budget: about how many values to sample (between ``budget`` and twice that).

    Returns:
        ``[already flushed, would flush, counted]`` as a tensor on the gradients' device, so
        that sampling adds no host synchronisation (read it when the trial ends), or ``None``
        without gradients.
    """
    import torch

    total = sum(g.numel() for g in grads)
    if not total:
        return None
    stride = max(1, total // budget)
    device = grads[0].device
    pieces, owners, offset = [], [], 0
    with torch.no_grad():
        for g in grads:
            first = -offset % stride  # where the global every-stride-th sequence enters this tensor
            if first < g.numel():
                pieces.append(g.detach().reshape(-1)[first::stride].to(device=device, dtype=torch.float32))
                owners.append(torch.full((pieces[-1].numel(),), len(owners), device=device))
            offset += g.numel()
        scaled = torch.cat(pieces).abs_().mul_(scale)  # cat copies: the gradients are not touched
        tensor_of = torch.cat(owners)

        def per_tensor(values: torch.Tensor) -> torch.Tensor:
            # index_add_ rather than bincount, which reads the largest index back to the host.
            counts = torch.zeros(len(owners), dtype=torch.long, device=device)
            return counts.index_add_(0, tensor_of, values.long())

        nonzero = (scaled > 0) & torch.isfinite(scaled)
        would_flush = nonzero & (scaled < FP16_MIN_SUBNORMAL)
        zeros, values, low = per_tensor(scaled == 0), per_tensor(nonzero), per_tensor(nonzero & (scaled < FP16_MIN_NORMAL))
        at_edge = (values > 0) & (2 * low > values)  # most of its values are subnormal in fp16
        healthy = (values > 0) & ~at_edge
        empty = values == 0
        flushed = (zeros * at_edge).sum() + (zeros * empty).sum() * (healthy.sum() == 0)
        return torch.stack([flushed, would_flush.sum(), nonzero.sum() + flushed])


def underflow_note(counts: list[list[int]]) -> str | None:
    """One line with both kinds of underflow over a trial's sampled steps, or ``None`` when no
    sampled value was lost.

    Args:
        counts: ``underflow_counts``'s ``[already flushed, would flush, counted]`` per sampled step.
    """
    flushed, would_flush, counted = (sum(c[i] for c in counts) for i in range(3))
    if not counted or not flushed + would_flush:
        return None
    return (
        f"fp16 gradient underflow over {len(counts)} sampled steps: {flushed / counted:.1%} of the sampled "
        f"gradient values had already flushed to zero, {would_flush / counted:.1%} would flush at the loss scale in use"
    )


def _fraction(counts: torch.Tensor) -> float | None:
    """The share of counted values lost to underflow (already flushed or would flush)."""
    flushed, would_flush, counted = (int(v) for v in counts.tolist())
    return (flushed + would_flush) / counted if counted else None


def underflow_fractions(counts: list[Any]) -> tuple[list[float | None], str | None]:
    """Per optimizer step, the share of its sampled gradient values lost to underflow (``None``
    where the step was not sampled), and the trial's note on it (``underflow_note``).

    Args:
        counts: per optimizer step, ``underflow_counts``'s tensor, or ``None``.
    """
    sampled = [[int(v) for v in c.tolist()] for c in counts if c is not None]
    return [None if c is None else _fraction(c) for c in counts], underflow_note(sampled)
