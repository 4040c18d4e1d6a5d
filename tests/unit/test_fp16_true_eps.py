"""fp16-true and the optimizer's eps: Adam's default 1e-8 is 0 in fp16.

In pure fp16 the optimizer state is fp16, so Adam's update m / (sqrt(v) + eps) divides by
fp16's eps: 1e-8 rounds to 0 there (fp16's smallest subnormal is 2**-24, about 6e-8), and any
zero gradient (a dead ReLU unit) makes 0/0 = NaN after the first step, with a loss nowhere
near fp16's range. It is not an overflow. eps=1e-4 trains (tests/gpu/test_cuda.py runs it).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy, Policy
from advisor.tune._stability import TrialCurve, judge
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__)
STEPS = 6


def _train(mode: str, eps: float) -> tuple[list[float], list[str]]:
    """A few AdamW steps of a small ReLU MLP on the CPU; the losses and the mode's notes."""
    torch.manual_seed(0)
    mp = AppliedPolicy(Policy(mode=mode), profile=CPU, source="test", device="cpu")
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3, eps=eps))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = mp.to_device(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
        with mp.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        mp.step(loss, optimizer)
        losses.append(loss.item())
    return losses, mp.notes


def test_adam_default_eps_makes_fp16_true_nan_and_the_note_says_why():
    losses, notes = _train("fp16-true", 1e-8)
    assert math.isfinite(losses[0]) and losses[0] < 10  # far from fp16's range: no overflow
    assert not all(math.isfinite(v) for v in losses)
    (note,) = [n for n in notes if "eps" in n]
    assert "eps=1e-08" in note and "0 in fp16" in note and "eps >= 1e-4" in note


def test_fp16_true_with_eps_1e_4_trains_without_the_note():
    losses, notes = _train("fp16-true", 1e-4)
    assert all(math.isfinite(v) for v in losses)
    assert not any("eps" in n for n in notes)


def test_the_divergence_verdict_names_eps_as_well_as_overflow_when_eps_is_unknown():
    # A trial that did not record the optimizer's eps: both causes and both fixes.
    reference, _ = _train("fp32", 1e-8)
    losses, _ = _train("fp16-true", 1e-8)
    verdict = judge(TrialCurve("fp16-true", losses), TrialCurve("fp32", reference))
    assert verdict.kind == "diverged"
    assert "eps" in verdict.reason and "1e-4" in verdict.reason
    assert "fp16-mixed" in verdict.reason


def test_the_divergence_verdict_blames_the_eps_the_trial_recorded():
    reference, _ = _train("fp32", 1e-8)
    losses, _ = _train("fp16-true", 1e-8)
    verdict = judge(TrialCurve("fp16-true", losses, optimizer_eps=1e-8), TrialCurve("fp32", reference))
    assert verdict.kind == "diverged"
    assert "eps=1e-08 is 0 in fp16" in verdict.reason and "overflows" not in verdict.reason


def test_a_trial_records_its_optimizers_eps_and_the_curve_carries_it():
    """The loop API's recorder writes the smallest unfused eps into the result; curve_of reads it."""
    from advisor.trial import TrialResult, optimizer_eps
    from advisor.tune._judge import curve_of

    net = nn.Linear(4, 4)
    groups = [{"params": [net.weight], "eps": 1e-6}, {"params": [net.bias], "eps": 1e-8}]
    assert optimizer_eps(torch.optim.AdamW(groups)) == 1e-8
    assert optimizer_eps(torch.optim.SGD(net.parameters(), lr=0.1)) is None
    result = TrialResult.from_dict({"outcome": "ok", "losses": [1.0, float("nan")], "optimizer_eps": 1e-8})
    assert curve_of(result, "fp16-true").optimizer_eps == 1e-8


@pytest.mark.parametrize(
    ("eps", "says_eps", "says_overflow"),
    [(1e-8, True, False), (2.0**-25, True, False), (1e-4, False, True), (None, True, True)],
)
def test_diverged_advice_follows_what_is_known_of_eps(eps, says_eps, says_overflow):
    from policies.fp16_true import Fp16True

    advice = Fp16True.advice("diverged", optimizer_eps=eps)
    assert ("eps >= 1e-4" in advice) is says_eps
    assert ("overflows" in advice) is says_overflow


def test_a_fused_adam_computes_in_fp32_and_gets_no_note():
    from policies.fp16_true import Fp16True

    steps = []
    optimizer = SimpleNamespace(param_groups=[{"eps": 1e-8, "fused": True}], step=lambda: steps.append(1))
    mode = Fp16True(Policy(mode="fp16-true"), torch.device("cpu"))
    assert mode.optimizer_step(optimizer) and steps == [1]
    assert mode.notes == []
