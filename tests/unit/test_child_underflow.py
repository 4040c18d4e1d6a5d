"""The fp16 underflow fraction: sampled in proportion to tensor size, counted below 2^-24 once scaled."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from advisor.trial import _child
from advisor.tune._run import FunctionRunner, TrialSettings
from policies import Policy

# GradScaler's initial scale, 2^16, stays put over a short clean trial (it grows after 2000 steps).
SCALE = 2.0**16
MATRIX, BETWEEN, VECTORS, VECTOR = (512, 512), (256, 256), 20, 256


class KnownGradients(nn.Module):
    """Parameters whose gradients are set exactly by the loss, in three bands once scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.zeros(*MATRIX))  # scaled gradient about 655: healthy
        self.between = nn.Parameter(torch.zeros(*BETWEEN))  # scaled 2^-20: subnormal, not flushed
        self.vectors = nn.ParameterList(nn.Parameter(torch.zeros(VECTOR)) for _ in range(VECTORS))  # 2^-30: flushed

    def loss(self) -> torch.Tensor:
        flushed = sum((v * 2.0**-46).sum() for v in self.vectors)
        return (self.matrix * 1e-2).sum() + (self.between * 2.0**-36).sum() + flushed


def train(mp) -> None:
    net = KnownGradients()
    # lr 0: the weights, and so the gradients, are the same on every step.
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.0))
    mp.micro_batch_size(1)
    while True:
        mp.step(model.loss(), optimizer)


def run(steps: int = 12):
    settings = TrialSettings(warmup_steps=1, measure_steps=steps - 1, device="cpu")
    result = FunctionRunner(train, settings)(Policy(mode="fp16-mixed"), "fp16-mixed")
    assert result.outcome == "ok", (result.reason, result.stderr_tail)
    return result


def test_fraction_weighs_each_tensor_by_its_size_and_counts_only_flushed_values() -> None:
    result = run()
    flushed = VECTORS * VECTOR
    nonzero = MATRIX[0] * MATRIX[1] + BETWEEN[0] * BETWEEN[1] + flushed
    measured = [u for u in result.underflow if u is not None]
    assert measured
    # 1.5%: a fixed sample per tensor made it 86% (the twenty small vectors outweighing the
    # matrices, and the subnormal band counted as lost).
    for fraction in measured:
        assert fraction == pytest.approx(flushed / nonzero, abs=0.002)
    assert all(s == SCALE for s in result.loss_scale)


def test_sampled_every_kth_step() -> None:
    result = run(steps=13)
    sampled = [i for i, u in enumerate(result.underflow) if u is not None]
    assert sampled == list(range(0, 13, _child.UNDERFLOW_EVERY))
    assert len(result.step_times) == len(result.losses) == len(result.loss_scale) == 13


def test_counts_directly() -> None:
    grads = [torch.full((1000,), 2.0**-42), torch.full((3000,), 1e-3), torch.zeros(500)]
    counts = _child.underflow_counts(grads, scale=SCALE, budget=400)
    flushed, would_flush, counted = (int(v) for v in counts.tolist())
    # The all-zero tensor beside a healthy one is sparse, not flushed: its zeros are not counted.
    assert flushed == 0 and would_flush / counted == pytest.approx(0.25, abs=0.01)
    assert _child._fraction(counts) == pytest.approx(0.25, abs=0.01)
    assert 350 <= counted <= 800  # about the budget, however many tensors there are
    assert _child.underflow_counts([], scale=SCALE) is None
    inf = _child.underflow_counts([torch.tensor([float("inf"), float("nan"), 2.0**-40])], scale=1.0)
    assert inf.tolist() == [0, 1, 1]  # a skipped step's inf/NaN gradients are not values that underflow


def _mostly_flushed(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A gradient 99.9% of whose values flushed to zero in fp16; the survivors sit just above
    fp16's smallest subnormal once scaled, as a flush leaves them."""
    grad = torch.zeros(100_000, dtype=dtype)
    grad[::1000] = 2.0**-20 / scale
    return grad


@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.float32, SCALE), (torch.float16, 1.0)], ids=["fp16-mixed (fp32 gradient)", "fp16-true"]
)
def test_a_gradient_that_flushed_to_zero_reports_what_it_lost(dtype: torch.dtype, scale: float) -> None:
    counts = _child.underflow_counts([_mostly_flushed(dtype, scale)], scale=scale)
    flushed, would_flush, counted = (int(v) for v in counts.tolist())
    assert (flushed, would_flush) == (99_900, 0)
    assert _child._fraction(counts) == pytest.approx(0.999, abs=0.001)


def test_structural_zeros_beside_healthy_values_are_not_underflow() -> None:
    torch.manual_seed(0)
    dead_units = torch.randn(256, 256) * 1e-3
    dead_units[::3] = 0  # a third of the rows: dead ReLU units, zero in fp32 too
    unused_rows = torch.zeros(50_000, 64)  # an embedding table: no sampled row was in the batch
    unused_rows[7] = 1e-3
    counts = _child.underflow_counts([dead_units, unused_rows], scale=SCALE)
    assert counts.tolist()[:2] == [0, 0] and _child._fraction(counts) == 0.0


def test_a_gradient_flushed_everywhere_is_all_lost() -> None:
    counts = _child.underflow_counts([torch.zeros(4096), torch.zeros(64)], scale=SCALE)
    assert _child._fraction(counts) == 1.0


def test_an_autocast_backward_that_flushed_is_seen() -> None:
    # A real fp16 backward under autocast: the parameters' gradients are fp32, but they came
    # through fp16 matmuls, so what flushed is held as exact zeros.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(torch.randn(64, 256))
    ((out.float() ** 2).mean() * 2.0**-27 * SCALE).backward()  # scaled, as GradScaler does
    grads = [p.grad / SCALE for p in net.parameters()]  # unscaled, as the recorder sees them
    zeros = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
    assert zeros > 0.3  # what fp32 would not have produced: the same backward in fp32 has none
    counts = _child.underflow_counts(grads, scale=SCALE)
    assert _child._fraction(counts) == pytest.approx(zeros, abs=0.02)


def test_the_note_reports_both_kinds() -> None:
    assert _child.underflow_note([[0, 0, 100], [0, 0, 100]]) is None
    note = _child.underflow_note([[50, 10, 100], [30, 10, 100]])
    assert note is not None and "40.0% of the sampled gradient values had already flushed" in note
    assert "10.0% would flush" in note
