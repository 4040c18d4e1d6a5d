"""The fp16 underflow fraction: sampled in proportion to tensor size, counted below 2^-24 once scaled."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from advisor.tune import _child
from advisor.tune._trials import FunctionRunner, TrialSettings
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
    flushed, nonzero = (int(v) for v in counts.tolist())
    assert flushed / nonzero == pytest.approx(0.25, abs=0.01)  # zeros are not counted at all
    assert 350 <= nonzero <= 800  # about the budget, however many tensors there are
    assert _child.underflow_counts([], scale=SCALE) is None
    inf = _child.underflow_counts([torch.tensor([float("inf"), float("nan"), 2.0**-40])], scale=1.0)
    assert inf.tolist() == [1, 1]  # a skipped step's inf/NaN gradients are not values that underflow
