"""A tuned answer that no longer applies falls back to the safer of the hardware's safe default
and the tuned mode: a workload tuned away from bf16-mixed to fp32 or tf32 (a loss floor, a
stall) must not get bf16-mixed back because a comment in the script changed."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fakes import Net, gpu_profile

import advisor
import probes
from advisor import _paths
from advisor._load import resolve_policy
from advisor.cli import _run
from advisor.runtime import AppliedPolicy
from advisor.runtime._workload import script_digest
from policies import Policy, TunedOn

A100 = gpu_profile("A100")  # safe default: bf16-mixed


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "train.py"
    path.write_text("optimizer = AdamW(net.parameters(), lr=1e-5)\n")
    monkeypatch.setattr(_paths, "current_script", lambda: path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    return path


def _tuned(script: Path, mode: str, *, profile: probes.HardwareProfile = A100) -> Policy:
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    model = Net()
    trial.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    trial.micro_batch_size(64)
    return Policy(mode=mode, tuned_on=TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(profile), device=profile.name,
        torch=profile.torch_version or "", cuda=profile.cuda_runtime or "",
        workload_fingerprint=trial.workload_fingerprint, model_signature=trial.model_signature,
        global_batch=64, script_digest=script_digest(script),
    ))


@pytest.mark.parametrize(("tuned", "fallback"), [("fp32", "fp32"), ("tf32", "tf32"), ("fp16-mixed", "bf16-mixed")])
def test_a_comment_edit_falls_back_to_the_safer_mode(
    script: Path, warnings: list[str], tuned: str, fallback: str
) -> None:
    policy = _tuned(script, tuned)
    script.write_text(script.read_text() + "# a comment\n")
    mp = AppliedPolicy(policy, profile=A100, source="cache entry #1", device="cpu", match_workload=True)
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    assert mp.mode == fallback and mp.policy.tuned_on is None
    assert len(warnings) == 1 and "script edited" in warnings[0]
    if fallback == tuned:
        # The mode stays: the line says so, not "tf32 instead of tf32".
        assert f"keeping {tuned} from cache entry #1: safer than the safe default bf16-mixed" in warnings[0]
        assert f"{tuned} instead of {tuned}" not in warnings[0]
    else:
        assert "using the safe default bf16-mixed" in warnings[0]


def test_a_policy_tuned_on_other_hardware_falls_back_to_the_safer_mode(script: Path, warnings: list[str]) -> None:
    _tuned(script, "fp32", profile=gpu_profile("H100")).save(_paths.config_path_for(script))
    resolution = resolve_policy(None, profile=A100, script=script, environ={})
    assert resolution.policy == Policy(mode="fp32") and resolution.mismatch is not None
    assert len(warnings) == 1 and "safer than the safe default bf16-mixed" in warnings[0]


def test_mpadvise_run_falls_back_to_the_safer_mode(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = _tuned(script, "tf32")
    monkeypatch.setattr(_run, "cached_answers", lambda profile, script: (policy, "cache entry #1 (tuned 2026-12-01)"))
    script.write_text(script.read_text() + "# a comment\n")
    assert _run.tuned_for_run(script, None, A100).policy == Policy(mode="tf32")


def test_the_fallback_is_a_mode_that_runs_here() -> None:
    from advisor.runtime._fallback import safe_fallback

    cpu = replace(probes.cpu_profile(), cpu_flags=("amx_bf16",))  # safe default bf16-mixed, no TF32 on a CPU
    assert safe_fallback(Policy(mode="tf32"), cpu) == Policy(mode="bf16-mixed")
    assert safe_fallback(Policy(mode="fp32", micro_batch_size=8), cpu) == Policy(mode="fp32")
    assert safe_fallback(Policy(mode="bf16-true"), A100) == Policy(mode="bf16-mixed")
