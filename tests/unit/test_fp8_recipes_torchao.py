"""fp8-torchao and a token count that is not a multiple of 16 (a ragged last batch).

The weight gradient's FP8 matmul sums over the tokens, and on CUDA ``torch._scaled_mm``
refuses an inner dimension that is not a multiple of 16. This CPU's ``_scaled_mm`` takes any
shape, so a fixture makes it as strict as CUDA's; the real one is in tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from advisor import AppliedPolicy
from policies import Fp8Options, Policy
from probes import HardwareProfile

pytest.importorskip("torchao.float8", reason="fp8-torchao needs torchao")

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__)
RAGGED = 10  # tokens in the last batch: not a multiple of 16


@pytest.fixture
def strict_scaled_mm(monkeypatch):
    """``torch._scaled_mm`` with CUDA's rule: the inner dimension a multiple of 16."""
    real = torch._scaled_mm

    def scaled_mm(a, b, *args, **kwargs):
        if a.shape[1] % 16:
            raise RuntimeError(f"mat1 inner dimension {a.shape[1]} is not divisible by 16")
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _setup(recipe: str | None = None):
    mp = AppliedPolicy(
        Policy(mode="fp8-torchao", fp8=Fp8Options(recipe=recipe) if recipe else None),
        profile=CPU,
        source="test",
        device="cpu",
    )
    net = _net()
    model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return mp, model, optimizer


@pytest.mark.parametrize(("recipe", "padded"), [(None, True), ("rowwise", True), ("rowwise_with_gw_hp", False)])
def test_the_config_pads_where_the_weight_gradient_runs_in_fp8(recipe, padded):
    _, model, _ = _setup(recipe)
    assert type(model[0]).__name__ == "Float8Linear"
    # rowwise_with_gw_hp computes the weight gradient in high precision: nothing to pad.
    assert model[0].config.pad_inner_dim is padded


@pytest.mark.parametrize("recipe", [None, "rowwise", "rowwise_with_gw_hp"])
def test_a_ragged_last_batch_trains(strict_scaled_mm, recipe):
    mp, model, optimizer = _setup(recipe)
    before = [p.detach().clone() for p in model.parameters()]
    for tokens in (32, RAGGED):
        x = mp.to_device(torch.randn(tokens, 32))
        with mp.autocast():
            loss = model(x).pow(2).mean()
        assert mp.step(loss, optimizer) and torch.isfinite(loss)
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_padding_leaves_the_gradients_as_they_were():
    """Zero rows add nothing to the weight gradient's sums: padded equals unpadded."""
    import dataclasses

    import torchao.float8 as float8

    x = torch.randn(RAGGED, 32)
    grads = []
    for pad in (False, True):
        config = dataclasses.replace(float8.Float8LinearConfig(), pad_inner_dim=pad)
        model = float8.convert_to_float8_training(_net(), config=config)
        model(x).pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for unpadded, padded in zip(*grads):
        torch.testing.assert_close(padded, unpadded)
