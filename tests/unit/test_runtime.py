"""The runtime object on real CPU numerics: every mode trains, matches a hand-written loop,
accumulates like a large batch, resumes exactly, and restores every switch it sets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor
from advisor import AppliedPolicy, LossScale, MpadviseError, Policy
from probes import HardwareProfile

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2, torch_version=torch.__version__)
CPU_MODES = ["fp32", "fp16-mixed", "bf16-mixed", "fp16-true", "bf16-true", "fp8-torchao"]


def applied(mode: str | Policy, **kwargs) -> AppliedPolicy:
    policy = mode if isinstance(mode, Policy) else Policy(mode=mode, **kwargs)
    return AppliedPolicy(policy, profile=CPU, source="test", device="cpu")


def make_model(width: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def make_data(n: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return x, y


def train(mp: AppliedPolicy, steps: int, *, batch: int = 32, lr: float = 1e-2, eps: float = 1e-8, model=None):
    model = model if model is not None else make_model()
    model, opt = mp.setup(model, torch.optim.AdamW(model.parameters(), lr=lr, eps=eps))
    x, y = make_data()
    losses = []
    for i in range(steps):
        lo = (i * batch) % len(x)
        xb, yb = mp.to_device(x[lo : lo + batch], y[lo : lo + batch])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, opt)
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("mode", CPU_MODES)
def test_every_mode_decreases_the_loss(mode):
    # AdamW's default eps=1e-8 is below fp16's smallest subnormal (6e-8) and rounds to 0, so
    # pure fp16 divides by zero on its first step; with a representable eps it trains. The
    # trial verdict catches the default case (see tests/integration).
    eps = 1e-4 if mode == "fp16-true" else 1e-8
    _, _, losses = train(applied(mode), steps=30, eps=eps)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert last < 0.8 * first, f"{mode}: {first:.3f} -> {last:.3f}"


def _hand_loop(dtype, use_scaler: bool, steps: int):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    x, y = make_data()
    params = []
    for i in range(steps):
        xb, yb = x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(xb).float(), yb)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        params.append([p.detach().clone() for p in model.parameters()])
    return params


@pytest.mark.parametrize(
    ("mode", "dtype", "scaler"),
    [("fp32", None, False), ("bf16-mixed", torch.bfloat16, False), ("fp16-mixed", torch.float16, True)],
)
def test_matches_hand_written_autocast_loop_step_for_step(mode, dtype, scaler):
    steps = 8
    expected = _hand_loop(dtype, scaler, steps)
    mp = applied(mode)
    model = make_model()
    model, opt = mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = make_data()
    for i in range(steps):
        xb, yb = mp.to_device(x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, opt)
        for got, want in zip(model.parameters(), expected[i]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_accumulating_four_micro_batches_of_16_equals_one_batch_of_64():
    x, y = make_data(64)
    big = make_model()
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    F.cross_entropy(big(x), y).backward()
    opt_big.step()

    mp = applied(Policy(mode="fp32", micro_batch_size=16))
    assert mp.micro_batch_size(64) == 16
    assert mp.grad_accum_steps == 4 and mp.global_batch == 64
    small, opt = mp.setup(make_model(), None), None
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    taken = []
    for i in range(4):
        xb, yb = mp.to_device(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
        with mp.autocast():
            loss = F.cross_entropy(small(xb), yb)
        taken.append(mp.step(loss, opt))
    assert taken == [False, False, False, True]
    for a, b in zip(small.parameters(), big.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["fp32", "fp16-mixed", "bf16-true"])
def test_checkpoint_mid_run_resumes_exactly(mode, tmp_path):
    policy = Policy(mode=mode, micro_batch_size=16) if mode != "fp16-mixed" else Policy(
        mode=mode, micro_batch_size=16, loss_scale=LossScale(init_scale=2.0**20, growth_interval=3)
    )
    x, y = make_data()

    def run(mp, model, opt, start, stop):
        for i in range(start, stop):
            xb, yb = mp.to_device(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, opt)

    mp = applied(policy)
    mp.micro_batch_size(32)
    model, opt = mp.setup(make_model(), None), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run(mp, model, opt, 0, 8)  # 4 optimizer steps: scaler growth and backoff both happened
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()), "mp": mp.state_dict()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    run(mp, model, opt, 8, 16)

    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    mp2 = applied(policy)
    mp2.micro_batch_size(32)
    model2 = mp2.setup(make_model(seed=5), None)
    model2.load_state_dict(loaded["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(loaded["opt"])
    mp2.load_state_dict(loaded["mp"])
    if mode == "fp16-mixed":
        assert mp2.loss_scale() == loaded["mp"]["mode_state"]["scaler"]["scale"]
    run(mp2, model2, opt2, 8, 16)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert mp2.loss_scale() == mp.loss_scale()
    assert mp2.optimizer_steps == mp.optimizer_steps


def _switch_state():
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.is_autocast_enabled("cpu"),
        torch.get_default_dtype(),
    )


@pytest.mark.parametrize("mode", CPU_MODES)
def test_switches_restored_after_exceptions(mode):
    before = _switch_state()
    mp = applied(mode)
    model = mp.setup(make_model())
    with pytest.raises(RuntimeError, match="boom"):
        with mp.autocast():
            model(mp.to_device(torch.randn(2, 16)))
            raise RuntimeError("boom")
    assert _switch_state() == before
    with pytest.raises(RuntimeError, match="boom"):
        with mp:
            raise RuntimeError("boom")
    assert _switch_state() == before


def test_tf32_context_sets_and_restores_matmul_precision():
    from policies.tf32 import Tf32

    torch.set_float32_matmul_precision("highest")
    mode = Tf32(Policy(mode="tf32"), torch.device("cpu"))
    with mode.process_switches():
        assert torch.get_float32_matmul_precision() == "high"
        with pytest.raises(ValueError):
            with mode.process_switches():
                raise ValueError
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"


def test_step_reports_skipped_fp16_steps():
    # A huge static loss scale makes every fp16 gradient overflow: GradScaler skips silently,
    # step() must say so.
    mp = applied(Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=2.0**40)))
    model = make_model()
    model, opt = mp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = make_data(32)
    with mp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    assert mp.step(loss, opt) is False
    assert mp.skipped_steps == 1 and mp.loss_scale() == 2.0**40
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_true_modes_cast_inputs_but_not_labels():
    mp = applied("bf16-true")
    x, y = mp.to_device(torch.randn(2, 3), torch.tensor([1, 2]))
    assert x.dtype == torch.bfloat16 and y.dtype == torch.int64
    nested = mp.to_device({"a": [torch.randn(1)], "b": 3})
    assert nested["a"][0].dtype == torch.bfloat16 and nested["b"] == 3


def test_gradient_clipping_on_unscaled_gradients():
    mp = applied(Policy(mode="fp16-mixed", grad_clip_norm=0.01))
    model = make_model()
    model, opt = mp.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = make_data(32)
    with mp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    assert mp.step(loss, opt)
    delta = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(model.parameters(), before)))
    assert float(delta.detach()) == pytest.approx(0.01, rel=1e-2)


def test_fp8_torchao_keeps_unaligned_layers_and_reports_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 1))
    mp = applied("fp8-torchao")
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert type(model[0]).__name__ == "Float8Linear"
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.Linear
    notes = " ".join(mp.notes)
    assert "2 (32->10)" in notes and "3 (10->1)" in notes and "emulated on CPU" in notes
    x = mp.to_device(torch.randn(32, 16))
    with mp.autocast():
        loss = model(x).pow(2).mean()
    assert mp.step(loss, opt) and torch.isfinite(loss)


def test_unsupported_mode_names_reason_and_available_modes(monkeypatch):
    monkeypatch.setattr("probes.primary_profile", lambda: CPU)
    with pytest.raises(MpadviseError) as info:
        advisor.load_policy(Policy(mode="fp8-te"), device=None)
    message = str(info.value)
    assert "fp8-te" in message and "available here:" in message and "fp32" in message


def test_micro_batch_size_rejects_bad_default():
    with pytest.raises(MpadviseError, match="expected a positive integer"):
        applied("fp32").micro_batch_size(0)


def test_setup_rejects_non_module():
    with pytest.raises(MpadviseError, match="expected a torch.nn.Module"):
        applied("fp32").setup("model")
