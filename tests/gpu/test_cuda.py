"""On a real GPU: probing, every supported mode training, loops matching hand-written ones,
switches restored, trials timing with CUDA events on their own device (cuda:1 too), trials
under torch.compile with CUDA graphs, the per-process memory cap, and NVML's view of this
process and of MIG instances."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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
    # The driver's files are what lets the probes import torch at all; without them: CPU only.
    assert probes.gpu_driver_present() and probes.primary_profile().kind == "cuda"
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
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "MPADVISE_HOME": str(tmp_path)},
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
    from advisor.trial import TrialSpec, run_trial

    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "r.json"), memory_limit=2**30)
    result = run_trial(script, [], spec, timeout=300)
    assert result.outcome == "oom", (result.reason, result.stderr_tail)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine is not installed")
def test_fp8_te_swaps_modules_and_trains_where_supported():
    if not supported_modes(profile())["fp8-te"].supported:
        pytest.skip(supported_modes(profile())["fp8-te"].reason)
    losses = _train("fp8-te")
    assert all(torch.isfinite(torch.tensor(losses)))


def _has_fp32_precision_api() -> bool:
    return hasattr(torch.backends, "fp32_precision")


def _max_relative_error(run) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1024, 1024, device="cuda", generator=g)
    b = torch.randn(1024, 1024, device="cuda", generator=g)
    exact = a.double() @ b.double()
    return ((run(a, b).double() - exact).abs().max() / exact.abs().max()).item()


@pytest.mark.skipif(not _has_fp32_precision_api(), reason="this torch has only the legacy TF32 API")
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_modes_train_under_the_new_tf32_api_and_restore_it(mode):
    if not supported_modes(profile())[mode].supported:
        pytest.skip(supported_modes(profile())[mode].reason)
    before = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        torch.backends.fp32_precision = "tf32"
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.cudnn.conv.fp32_precision = "none"
        losses = _train(mode, steps=5)
        assert all(torch.isfinite(torch.tensor(losses)))
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # inherited again
        torch.backends.fp32_precision = "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


@pytest.mark.skipif(not _has_fp32_precision_api(), reason="this torch has only the legacy TF32 API")
def test_fp32_turns_tf32_off_for_real_matmuls_where_the_new_api_turned_it_on():
    if not supported_modes(profile())["tf32"].supported:
        pytest.skip("TF32 needs compute capability >= 8.0")
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        tf32_error = _max_relative_error(torch.mm)
        mp = AppliedPolicy(Policy(mode="fp32"), profile=profile(), source="test", device="cuda:0")
        with mp:
            fp32_error = _max_relative_error(torch.mm)
        # TF32 keeps 10 mantissa bits, fp32 23: relative errors near 1e-4 and 1e-7 here.
        assert fp32_error < 1e-5 < tf32_error
        assert _max_relative_error(torch.mm) > 1e-5  # TF32 again after the block
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine is not installed")
def test_fp8_te_runs_the_rest_of_the_forward_in_bf16():
    if not supported_modes(profile())["fp8-te"].supported:
        pytest.skip(supported_modes(profile())["fp8-te"].reason)
    mp = AppliedPolicy(Policy(mode="fp8-te"), profile=profile(), source="test", device="cuda:0")
    model = mp.setup(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)))
    x = mp.to_device(torch.randn(32, 64))
    with mp.autocast():
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        scores = x @ x.T  # an op outside TE's modules, as attention's is
        out = model(x)
    assert scores.dtype == torch.bfloat16
    assert torch.isfinite(out).all()


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine is not installed")
def test_fp8_te_keeps_a_tied_head_tied():
    if not supported_modes(profile())["fp8-te"].supported:
        pytest.skip(supported_modes(profile())["fp8-te"].reason)

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 64)
            self.lm_head = nn.Linear(64, 256, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, tokens):
            return self.lm_head(self.embed(tokens))

    torch.manual_seed(0)
    net = TiedLM()
    mp = AppliedPolicy(Policy(mode="fp8-te"), profile=profile(), source="test", device="cuda:0")
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    assert type(model.lm_head).__module__.startswith("transformer_engine")
    assert model.lm_head.weight is model.embed.weight
    trained = [p for group in opt.param_groups for p in group["params"]]
    assert sum(p is model.embed.weight for p in trained) == 1
    tokens = torch.randint(0, 256, (4, 32), device="cuda")
    old = model.embed.weight.detach().clone()
    with mp.autocast():
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
    mp.step(loss, opt)
    assert model.lm_head.weight is model.embed.weight
    assert not torch.equal(model.embed.weight.detach(), old)


# --- trials on another device, and under torch.compile with CUDA graphs --------------------------

DEVICE_SCRIPT = """
import json, sys, time
import torch
import advisor

mp = advisor.load_policy()
net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=1e-4))
x = mp.to_device(torch.randn(2048, 2048))
mp.micro_batch_size(2048)
facts = {"current": [], "plain_cuda": [], "host_s": []}
while True:
    facts["current"].append(torch.cuda.current_device())
    facts["plain_cuda"].append(torch.empty(1, device="cuda").device.index)
    with open(sys.argv[1], "w") as f:
        json.dump(facts, f)
    torch.cuda.synchronize(mp.device)
    start = time.perf_counter()
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.step(loss, optimizer)
    torch.cuda.synchronize(mp.device)
    facts["host_s"].append(time.perf_counter() - start)
"""


def test_a_trial_on_cuda_1_runs_and_times_on_device_1(tmp_path, second_gpu):
    from advisor.trial import TrialSpec, run_trial

    script = tmp_path / "on_device.py"
    script.write_text(DEVICE_SCRIPT)
    facts_path = tmp_path / "facts.json"
    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "r.json"),
                     warmup_steps=3, measure_steps=10, device=second_gpu)
    result = run_trial(script, [str(facts_path)], spec, timeout=300)
    assert result.outcome == "ok", (result.reason, result.stderr_tail)
    facts = json.loads(facts_path.read_text())
    assert result.device == "cuda:1"
    assert set(facts["current"]) == {1}, "the trial's device is the current device in the child"
    assert set(facts["plain_cuda"]) == {1}, 'a plain "cuda" in the script lands on the trial device'
    # The events time device 1's work: close to the host's synchronised clock around the same
    # steps (recorded on idle device 0 they would read almost nothing).
    measured = sorted(result.step_times[spec.warmup_steps:])[len(result.step_times[spec.warmup_steps:]) // 2]
    host = sorted(facts["host_s"][spec.warmup_steps:])[len(facts["host_s"][spec.warmup_steps:]) // 2]
    assert 0.5 * host < measured < 2.0 * host, (measured, host)
    assert result.peak_memory and result.peak_memory > 6 * 2048 * 2048 * 4  # the weights, on device 1


COMPILED_SCRIPT = """
import json, sys
import torch
import torch.nn.functional as F
import advisor


def loss_of(x, y):  # the loss is a CUDA graph output: each replay writes it into the same memory
    return F.mse_loss(model(x), y)


# Before load_policy() starts the no-step clock, the work that is neither a compilation nor a
# step: torch.compile() itself imports Dynamo and Inductor's configuration (seconds when cold:
# 4 s for torch._dynamo alone on a loaded 2-core machine, and no compile callback is
# registered yet to see it), and the first CUDA matmul creates the context and cuBLAS's
# handle. torch.compile() only wraps the function; it compiles at the first call.
compiled = torch.compile(loss_of, mode="reduce-overhead")
(torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()

mp = advisor.load_policy()
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=1e-2))
g = torch.Generator().manual_seed(0)
data = [(torch.randn(128, 64, generator=g), torch.randn(128, 1, generator=g)) for _ in range(8)]
mp.micro_batch_size(128)
seen = []
step = 0
while True:
    x, y = mp.to_device(*data[step % len(data)])
    with mp.autocast():
        loss = compiled(x, y)
    seen.append(loss.item())
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
    mp.step(loss, optimizer)
    step += 1
"""


def test_torch_compile_with_cuda_graphs_records_every_steps_own_loss(tmp_path):
    from advisor.trial import TrialSpec, run_trial

    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_SCRIPT)
    seen_path = tmp_path / "seen.json"
    # A no-step timeout shorter than a cold Inductor compilation: compile time must not count.
    # The script imports torch.compile's modules and starts CUDA before load_policy() (see
    # there), so the 3 s cover only what the watchdog is meant to time: the script's own work
    # outside compilations up to its first step, a fraction of a second for this model.
    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "r.json"),
                     warmup_steps=3, measure_steps=12, first_step_timeout=3.0)
    result = run_trial(script, [str(seen_path)], spec, timeout=600)
    assert result.outcome == "ok", (result.reason, result.stderr_tail)
    seen = json.loads(seen_path.read_text())
    losses = list(result.losses)
    assert len(losses) == 15
    assert len(set(losses)) == len(losses), "one distinct loss per step, not the last replay's"
    assert losses == pytest.approx(seen[: len(losses)], rel=1e-6)


def test_matmul_benchmark_gives_its_gpu_memory_back():
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(0)
    probes.matmul_benchmark(profile(), dtypes=("fp32", "bf16"), size=4096, min_seconds=0.05)
    assert torch.cuda.memory_reserved(0) <= before  # 4096 x 4096 operands are 64 MiB each


def test_gpu_busy_never_waits_on_this_process():
    from probes import _nvml

    torch.zeros(1, device="cuda:0")  # a CUDA context: NVML lists this process from now on
    p = profile()
    with _nvml._nvml_session(None) as session:
        assert session is not None, "NVML should load on a real GPU"
        handle = session.handle_by_uuid(p.uuid) if p.uuid else session.call("nvmlDeviceGetHandleByIndex", 0)
        listed = session.call("nvmlDeviceGetComputeRunningProcesses", handle) or []
    busy = probes.gpu_busy(p.index or 0, uuid=p.uuid)
    assert os.getpid() not in busy
    if len(listed) <= 1:  # NVML lists this process alone (under its host PID in a container)
        assert busy == []


def _bare_uuid(uuid: object) -> str:
    """A UUID without NVML's ``GPU-``/``MIG-`` prefix, lower case: torch prints it bare."""
    text = str(uuid).strip().lower()
    return text.split("-", 1)[1] if text.startswith(("gpu-", "mig-")) else text


def _nvidia_smi_migs() -> dict[str, set[str]] | None:
    """What ``nvidia-smi -L`` lists: each GPU's bare UUID -> its MIG instances' bare UUIDs
    (empty for a GPU in MIG mode off); ``None`` where nvidia-smi does not run."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus: dict[str, set[str]] = {}
    # "GPU 0: NVIDIA H200 (UUID: GPU-...)", and under a GPU in MIG mode one line per instance,
    # "  MIG 1g.18gb     Device  0: (UUID: MIG-...)".
    for kind, uuid in re.findall(r"UUID:\s*(GPU|MIG)-([^\s)]+)", listing):
        if kind == "GPU":
            gpus[uuid.lower()] = set()
        elif gpus:
            gpus[list(gpus)[-1]].add(uuid.lower())
    return gpus


def _cuda0_is_mig() -> tuple[bool | None, str]:
    """Whether torch's cuda:0 is a MIG instance, told without the code under test: from
    ``CUDA_VISIBLE_DEVICES`` naming a MIG UUID, or from ``nvidia-smi -L`` and the UUID
    torch itself gives cuda:0. ``(None, why)`` where neither can tell."""
    first_visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first_visible.upper().startswith("MIG-"):
        return True, f"CUDA_VISIBLE_DEVICES names {first_visible}"
    gpus = _nvidia_smi_migs()
    if gpus is None:
        return None, "nvidia-smi -L did not run"
    torch_uuid = _bare_uuid(torch.cuda.get_device_properties(0).uuid)
    if any(torch_uuid in instances for instances in gpus.values()):
        return True, f"nvidia-smi -L lists torch's cuda:0 ({torch_uuid}) as a MIG instance"
    if torch_uuid in gpus:
        # A GPU in MIG mode runs CUDA only in its instances, so a UUID of such a GPU is the
        # parent's, reported for an instance.
        if gpus[torch_uuid]:
            return True, f"torch's cuda:0 ({torch_uuid}) is a GPU that nvidia-smi -L shows in MIG mode"
        return False, f"nvidia-smi -L lists torch's cuda:0 ({torch_uuid}) as a whole GPU, MIG off"
    # A driver before R470 names MIG instances MIG-GPU-<uuid>/<gi>/<ci>, which torch does not print.
    return None, f"nvidia-smi -L does not list torch's cuda:0 UUID {torch_uuid}"


def test_mig_is_reported_as_the_driver_sees_it():
    # Whether cuda:0 is a MIG instance is decided here, not from the profile under test: a
    # profile that lost its MIG UUID would otherwise skip the test instead of failing it.
    mig, why = _cuda0_is_mig()
    if mig is None:
        pytest.skip(f"cannot tell whether cuda:0 is a MIG instance: {why}")
    p = profile()
    if mig:
        assert (p.uuid or "").upper().startswith("MIG-"), (p.uuid, why)
        assert p.mig_enabled is True, why
        # The instance's own memory, not its parent GPU's.
        assert p.memory_free is not None and p.memory_free <= p.memory_total, why
    else:
        assert _bare_uuid(p.uuid) == _bare_uuid(torch.cuda.get_device_properties(0).uuid), (p.uuid, why)
        assert (p.uuid or "").upper().startswith("GPU-"), (p.uuid, why)
        assert p.mig_enabled is not True, why  # False, or None on a card without MIG


def test_a_tune_on_the_gpu_counts_flops_and_reports_tflops_and_mfu_below_the_probed_peak():
    # examples/mlp.py on the GPU: the reference's FLOPs are counted, and every candidate's MFU
    # is a share of the matmul peak the probe measured here, so it lies between 0 and 1.
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "tune", "examples/mlp.py", "--trials", "4",
                           "--json", "--no-cache", "--", "--width", "1024"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["flops_per_step"] and data["flops_basis"] == "counted" and data["peak_tflops"]
    measured = [row for row in data["candidates"] if row["tflops"] is not None]
    assert measured and all(row["tflops"] > 0 for row in measured)
    assert all(0 < row["mfu"] < 1 for row in measured if row["mfu"] is not None)
    assert data["cost"]["trials"] >= 2 and data["cost"]["window_s"] > 0
