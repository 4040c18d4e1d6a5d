"""On a real FP8 GPU: what setup() converts, that the matmuls really run in FP8, that a ragged
last batch trains, and that the recipe support mpadvise decides agrees with the library's own.

Each test skips with the reason where CUDA, an FP8-capable GPU or the library is absent.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.nn as nn

import probes
from advisor import AppliedPolicy, Policy
from policies import TE_RECIPES, TORCHAO_RECIPES, Fp8Options, supported_modes
from policies.fp8_te import RECIPE_CLASSES
from probes import MpadviseError
from probes._capability import torch_build_covers

pytestmark = pytest.mark.gpu


def profile():
    (first, *_) = probes.cuda_profiles()
    return first


def _policy(mode: str, recipe: str | None = None) -> Policy:
    return Policy(mode=mode, fp8=Fp8Options(recipe=recipe) if recipe else None)


def _require(mode: str, recipe: str | None = None) -> None:
    """Skip, with the reason, where the mode or its recipe does not run on this GPU."""
    library = {"fp8-torchao": "torchao", "fp8-te": "transformer_engine"}[mode]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    support = supported_modes(profile(), _policy(mode, recipe))[mode]
    if not support.supported:
        pytest.skip(support.reason)


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 64->256 and 256->64 can run in FP8; 64->10 cannot (10 is not a multiple of 16).
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 10))


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Count the FP8 matmuls (``torch._scaled_mm``) that run."""
    calls = []
    real = torch._scaled_mm

    def counted(a, b, *args, **kwargs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def _train(mp, model, optimizer, token_counts):
    losses = []
    g = torch.Generator().manual_seed(1)
    for tokens in token_counts:
        x, y = mp.to_device(torch.randn(tokens, 64, generator=g), torch.randint(0, 10, (tokens,), generator=g))
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        assert mp.step(loss, optimizer)
        losses.append(loss.item())
    return losses


def test_the_probe_records_a_torch_build_that_covers_this_gpu():
    p = profile()
    assert p.cuda_arch_list == tuple(torch.cuda.get_arch_list())
    assert torch_build_covers(p.compute_capability, p.cuda_arch_list) is not False


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_fp8_torchao_setup_makes_eligible_layers_float8linear(recipe, scaled_mm_calls):
    _require("fp8-torchao", recipe)
    from torchao.float8.float8_linear import Float8Linear

    mp = AppliedPolicy(_policy("fp8-torchao", recipe), profile=profile(), source="test", device="cuda:0")
    net = _net()
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    assert type(model[3]) is nn.Linear
    assert any("3 (64->10)" in note for note in mp.notes)
    assert model[0].weight.device.type == "cuda"
    losses = _train(mp, model, optimizer, [64])
    assert all(torch.isfinite(torch.tensor(losses)))
    # Forward and input gradient of both FP8 layers, plus the weight gradients where the
    # recipe runs them in FP8: the matmuls really ran in FP8.
    assert len(scaled_mm_calls) >= 4


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_torchao_trains_through_a_ragged_last_batch(recipe, scaled_mm_calls):
    _require("fp8-torchao", recipe)
    mp = AppliedPolicy(_policy("fp8-torchao", recipe), profile=profile(), source="test", device="cuda:0")
    net = _net()
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert model[0].config.pad_inner_dim
    losses = _train(mp, model, optimizer, [64, 64])
    before = model[0].weight.detach().clone()
    scaled_mm_calls.clear()
    losses += _train(mp, model, optimizer, [50])  # 50 tokens: not a multiple of 16
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(model[0].weight.detach(), before)
    # The first layer's weight gradient ran in FP8, over the 50 tokens padded with zeros to 64:
    # (out 256 x tokens) @ (tokens x in 64).
    assert ((256, 64), (64, 64)) in scaled_mm_calls
    assert all(a[1] % 16 == 0 for a, _ in scaled_mm_calls)


def _te_checks():
    """Transformer Engine's own support checks (pytorch/quantization.py from 2.9, fp8.py before)."""
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "check_fp8_support"):
            return module
    pytest.skip("this Transformer Engine has no check_fp8_support")


@pytest.mark.parametrize("recipe", TE_RECIPES)
def test_recipe_support_agrees_with_transformer_engine(recipe):
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("transformer-engine is not installed")
    checks = _te_checks()
    check = {
        "delayed": "check_fp8_support",
        "current": "check_fp8_support",
        "mxfp8": "check_mxfp8_support",
        "block": "check_fp8_block_scaling_support",
    }[recipe]
    from transformer_engine.common import recipe as te_recipe

    if not hasattr(checks, check) or not hasattr(te_recipe, RECIPE_CLASSES[recipe]):
        pytest.skip(f"this Transformer Engine has no {recipe} recipe")
    theirs, why = getattr(checks, check)()
    ours = supported_modes(profile(), _policy("fp8-te", recipe))["fp8-te"]
    if theirs and not ours.supported and profile().compute_capability >= (12, 0):
        pytest.skip("TE before 2.6 did not check MXFP8 on 12.x; mpadvise refuses it for every version")
    assert ours.supported == theirs, (ours.reason, why)


def test_fp8_te_refuses_a_ragged_batch_with_the_fix():
    _require("fp8-te")
    mp = AppliedPolicy(_policy("fp8-te"), profile=profile(), source="test", device="cuda:0")
    net = _net()
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert type(model[0]).__module__.startswith("transformer_engine")
    assert type(model[3]) is nn.Linear
    assert all(torch.isfinite(torch.tensor(_train(mp, model, optimizer, [64, 64]))))
    with pytest.raises(MpadviseError, match=r"shape \(50, 64\), 50 tokens.*drop_last=True"):
        _train(mp, model, optimizer, [50])


class _Attention(nn.Module):
    """MultiheadAttention (whose out_proj is never called), a bias-free LayerNorm, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.norm = nn.LayerNorm(64, bias=False)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        return self.proj(self.norm(self.attn(x, x, x, need_weights=False)[0]))


@pytest.mark.parametrize("mode", ["fp8-torchao", "fp8-te"])
def test_both_fp8_modes_keep_the_attention_out_proj_and_the_layernorm(mode):
    _require(mode)
    mp = AppliedPolicy(_policy(mode), profile=profile(), source="test", device="cuda:0")
    net = _Attention()
    names = [name for name, _ in net.named_parameters()]
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model.norm) is nn.LayerNorm  # no bias added by a swap
    assert type(model.proj) is not nn.Linear
    assert any("attn.out_proj (64->64)" in note and "MultiheadAttention" in note for note in mp.notes)
    assert [name for name, _ in model.named_parameters()] == names
    x = mp.to_device(torch.randn(4, 16, 64))
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    assert mp.step(loss, optimizer) and torch.isfinite(loss)


@pytest.mark.parametrize("recipe", [None, "delayed", "current"])
def test_fp8_te_in_a_compiled_step_runs_or_names_the_recipe(recipe):
    # TE 2.15 and newer refuses DelayedScaling when its autocast is entered in compiled code,
    # which crashed the step. Where Dynamo traces mp.autocast(), the default recipe gives way
    # to current (with a note) and a named delayed one is refused with the fix; where Dynamo
    # runs the frame eagerly instead (a graph break it cannot resume from), TE runs as asked.
    _require("fp8-te", recipe)
    mp = AppliedPolicy(_policy("fp8-te", recipe), profile=profile(), source="test", device="cuda:0")
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))

    @torch.compile(backend="eager")
    def forward(x):
        with mp.autocast():
            return model(x).float().pow(2).mean()

    loss = forward(mp.to_device(torch.randn(64, 64)))
    assert torch.isfinite(loss)
    try:
        assert mp.step(loss, optimizer)
    except MpadviseError as exc:
        assert recipe == "delayed" and 'set recipe = "current"' in str(exc) and "torch.compile" in str(exc)
