"""On a real GPU: probing, every supported mode training, loops matching hand-written ones,
switches restored, trials timing with CUDA events, and the per-process memory cap."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import probes
from advisor import AppliedPolicy, Policy
from policies import supported_modes

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def profile():
    (first, *_) = probes.cuda_profiles()
    return first


def test_probe_reads_the_gpu():
    p = profile()
    assert p.kind == "cuda" and p.compute_capability is not None and p.sm_count
    assert p.memory_total and p.memory_total > 2**30
    assert p.driver_version, "NVML should report the driver on a real GPU"
    assert len(probes.hardware_fingerprint(p)) == 16
    modes = supported_modes(p)
    assert modes["fp32"].supported and modes["fp16-mixed"].supported


def test_matmul_benchmark_puts_tensor_cores_ahead_of_fp32():
    rows = {r.dtype: r for r in probes.matmul_benchmark(profile()) if r.skipped is None}
    half = "bf16" if "bf16" in rows else "fp16"
    assert rows[half].tflops > 2 * rows["fp32"].tflops


def _train(mode: str, steps: int = 30) -> list[float]:
    torch.manual_seed(0)
    mp = AppliedPolicy(Policy(mode=mode), profile=profile(), source="test", device="cuda:0")
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16))
    eps = 1e-4 if mode == "fp16-true" else 1e-8
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3, eps=eps))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=g)
    y = (x @ torch.randn(64, 16, generator=g)).argmax(1)
    losses = []
    for i in range(steps):
        xb, yb = mp.to_device(x[(i * 64) % 512 : (i * 64) % 512 + 64], y[(i * 64) % 512 : (i * 64) % 512 + 64])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, opt)
        losses.append(loss.item())
    return losses


def _gpu_modes() -> list[str]:
    if not torch.cuda.is_available():
        return ["fp32"]
    support = supported_modes(profile())
    return [m for m, s in support.items() if s.supported]


@pytest.mark.parametrize("mode", _gpu_modes())
def test_every_supported_mode_trains_on_the_gpu(mode):
    losses = _train(mode)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


@pytest.mark.parametrize(("mode", "dtype"), [("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16)])
def test_matches_hand_written_cuda_loop(mode, dtype):
    if not supported_modes(profile())[mode].supported:
        pytest.skip(f"{mode} is not supported on {profile().name}")
    torch.manual_seed(0)
    hand = nn.Linear(32, 8).cuda()
    mine = nn.Linear(32, 8)
    mine.load_state_dict({k: v.cpu() for k, v in hand.state_dict().items()})
    opt_h = torch.optim.SGD(hand.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    mp = AppliedPolicy(Policy(mode=mode), profile=profile(), source="test", device="cuda:0")
    mine, opt_m = mp.setup(mine, torch.optim.SGD(mine.parameters(), lr=0.1))
    for _ in range(5):
        x = torch.randn(16, 32, device="cuda")
        with torch.autocast("cuda", dtype=dtype):
            loss = hand(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt_h)
        scaler.update()
        opt_h.zero_grad()
        with mp.autocast():
            loss_m = mine(x).float().pow(2).mean()
        mp.step(loss_m, opt_m)
    for a, b in zip(hand.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b)


def test_tf32_switches_set_and_restored():
    if not supported_modes(profile())["tf32"].supported:
        pytest.skip("tf32 needs compute capability >= 8.0")
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    mp = AppliedPolicy(Policy(mode="tf32"), profile=profile(), source="test", device="cuda:0")
    with mp:
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()) == before


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_fp8_torchao_swaps_and_trains_where_supported():
    if not supported_modes(profile())["fp8-torchao"].supported:
        pytest.skip(supported_modes(profile())["fp8-torchao"].reason)
    losses = _train("fp8-torchao")
    assert all(torch.isfinite(torch.tensor(losses)))


def _trial(tmp_path, mode: str, extra: list[str]) -> dict:
    script = ROOT / "tests/integration/scripts/tiny_ok.py"
    proc = subprocess.run(
        [sys.executable, "-m", "advisor.cli", "trial", str(script), "-m", mode, "--steps", "32", "--warmup", "3",
         "--json", *extra, "--", "60"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**__import__("os").environ, "MPADVISE_HOME": str(tmp_path)},
    )
    assert proc.returncode in (0, 3), proc.stderr
    return json.loads(proc.stdout)


def test_trial_on_the_gpu_reports_cuda_memory(tmp_path):
    data = _trial(tmp_path, "fp16-mixed", [])
    assert data["reference"]["memory_kind"] == "cuda-peak-allocated"
    assert data["candidates"][0]["step_time"]["median"] > 0


def test_memory_limit_is_a_real_cap_on_cuda(tmp_path):
    script = tmp_path / "big.py"
    script.write_text(
        "import torch, advisor\n"
        "mp = advisor.load_policy()\n"
        "m = mp.setup(torch.nn.Linear(8, 8))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "with mp.autocast():\n    loss = m(mp.to_device(torch.randn(4, 8))).sum()\n"
        "mp.step(loss, opt)\n"
        "x = torch.empty(8 * 2**30, dtype=torch.uint8, device='cuda')\n"
    )
    from probes._trial import TrialSpec, run_trial

    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "r.json"), memory_limit=2**30)
    result = run_trial(script, [], spec, timeout=300)
    assert result.outcome == "oom", (result.reason, result.stderr_tail)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine is not installed")
def test_fp8_te_swaps_modules_and_trains_where_supported():
    if not supported_modes(profile())["fp8-te"].supported:
        pytest.skip(supported_modes(profile())["fp8-te"].reason)
    losses = _train("fp8-te")
    assert all(torch.isfinite(torch.tensor(losses)))
