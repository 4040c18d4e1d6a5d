"""A second ``load_policy()`` in a plain run gets the policy the workload check decided on.

A script may call ``load_policy()`` twice (in its training loop and in a helper module, or
again for evaluation). The tuned answer is checked against the workload where ``setup()`` sees
the model; an object that never sees ``setup()`` must not apply the answer that check turned
down. As in a trial, where the second call returns the same object, a plain run returns one
object per resolved tuned answer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fakes import Net

import advisor
import probes
from advisor import _paths
from advisor.cache._recommend import record_tune
from advisor.runtime._workload import script_digest
from policies import Policy, TunedOn, safe_default_mode


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "project" / "train.py"
    path.parent.mkdir()
    path.write_text("optimizer = AdamW(net.parameters(), lr=1e-5)\n")
    monkeypatch.setattr(_paths, "current_script", lambda: path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    return path


def _cpu() -> probes.HardwareProfile:
    return probes.cpu_profile()


def _safe_default() -> str:
    return safe_default_mode(_cpu())[0]


def _tuned_mode() -> str:
    return "bf16-mixed" if _safe_default() != "bf16-mixed" else "fp16-mixed"


def _setup(mp: advisor.AppliedPolicy, lr: float) -> None:
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    mp.micro_batch_size(64)


def _record(script: Path) -> None:
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _setup(trial, 1e-5)
    policy = Policy(mode=_tuned_mode(), tuned_on=TunedOn(
        model_signature=trial.model_signature, global_batch=64, script_digest=script_digest(script),
    ))
    assert record_tune(profile=_cpu(), policy=policy, script=script, workload_fingerprint=trial.workload_fingerprint or "",
                       trials=[], speedup_vs_fp32=1.5, goodput=150.0) is not None


def test_a_second_call_after_a_miss_gets_the_fallback(script: Path, warnings: list[str]) -> None:
    _record(script)
    first = advisor.load_policy(device="cpu")
    _setup(first, 1e-3)  # another learning rate: the cached answer misses
    assert first.mode == _safe_default()
    second = advisor.load_policy(device="cpu")
    assert second.mode == _safe_default()
    assert len(warnings) == 1  # the miss is reported once


def test_a_second_call_made_before_setup_follows_the_check(script: Path, warnings: list[str]) -> None:
    _record(script)
    evaluation = advisor.load_policy(device="cpu")
    training = advisor.load_policy(device="cpu")
    _setup(training, 1e-3)
    assert training.mode == evaluation.mode == _safe_default()
    x = evaluation.to_device(torch.randn(4, 16))
    with evaluation.autocast():  # the safe default's dtype, not the tuned fp16's or bf16's
        assert Net()(x).dtype == {"fp32": torch.float32, "bf16-mixed": torch.bfloat16}[_safe_default()]


def test_a_second_call_after_a_match_keeps_the_tuned_answer(script: Path, warnings: list[str]) -> None:
    _record(script)
    _setup(advisor.load_policy(device="cpu"), 1e-5)
    assert advisor.load_policy(device="cpu").mode == _tuned_mode() and warnings == []


def test_explicit_policies_stay_separate_objects() -> None:
    first = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    assert advisor.load_policy(Policy(mode="fp32"), device="cpu") is not first
