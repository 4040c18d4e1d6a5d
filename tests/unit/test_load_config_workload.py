"""The config file beside the script: a tune's answer applies only to the workload it was tuned on.

``mpadvise tune`` writes ``<script>.mpadvise.toml`` with a ``[tuned_on]`` table that carries the
workload fingerprint, and ``load_policy()`` reads that file before the cache. A changed learning
rate, optimizer or argument must then miss as a cached answer does. A file a person wrote (no
workload fingerprint) is applied as written, and a file named explicitly (a path argument or
``MPADVISE_POLICY``) is checked against the model's structure only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _as_script import run_as
from fakes import Net

import advisor
import probes
from advisor import _paths
from advisor.runtime._workload import script_digest
from policies import Policy, TunedOn, safe_default_mode

SCRIPT_TEXT = "optimizer = AdamW(net.parameters(), lr={lr})\n"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home



@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "project" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT_TEXT.format(lr="1e-5"))
    run_as(monkeypatch, path)
    return path


def _cpu() -> probes.HardwareProfile:
    return probes.cpu_profile()


def _safe_default() -> str:
    return safe_default_mode(_cpu())[0]


def _tuned_mode() -> str:
    # A mode other than the safe default, so that which one applies is visible.
    return "bf16-mixed" if _safe_default() != "bf16-mixed" else "fp16-mixed"


def _train(mp: advisor.AppliedPolicy, *, lr: float = 1e-5, batch: int = 64) -> None:
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=lr))
    mp.micro_batch_size(batch)


def _tuned_policy(script: Path, mode: str, *, lr: float = 1e-5, batch: int = 64) -> Policy:
    """The policy ``mpadvise tune`` writes beside the script: [tuned_on] with the workload."""
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _train(trial, lr=lr, batch=batch)
    profile = _cpu()
    return Policy(mode=mode, tuned_on=TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(profile), device=profile.name,
        torch=profile.torch_version or "", workload_fingerprint=trial.workload_fingerprint,
        model_signature=trial.model_signature, global_batch=batch, script=str(script),
        script_digest=script_digest(script),
    ))


def test_the_tuned_workload_applies_the_config_file(script: Path, warnings: list[str]) -> None:
    config = _tuned_policy(script, _tuned_mode()).save(_paths.config_path_for(script))
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == _tuned_mode() and mp.source == f"config file {config}"
    assert warnings == []


def test_a_changed_learning_rate_misses_the_tuned_config_file(script: Path, warnings: list[str]) -> None:
    _tuned_policy(script, _tuned_mode()).save(_paths.config_path_for(script))
    script.write_text(SCRIPT_TEXT.format(lr="1e-3"))
    mp = advisor.load_policy(device="cpu")
    _train(mp, lr=1e-3)
    assert mp.mode == _safe_default() and mp.source.startswith("safe default")
    assert len(warnings) == 1
    assert warnings[0].startswith("workload changed since tuning (script edited; ")
    assert "now AdamW(lr=0.001, " in warnings[0] and "train.mpadvise.toml" in warnings[0]


def test_other_arguments_miss_the_tuned_config_file(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    run_as(monkeypatch, script, "--epochs", "1")
    _tuned_policy(script, _tuned_mode()).save(_paths.config_path_for(script))
    run_as(monkeypatch, script, "--epochs", "2")
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == _safe_default()
    assert len(warnings) == 1 and "arguments: --epochs 2)" in warnings[0]


def test_a_hand_written_config_file_is_applied_as_written(script: Path, warnings: list[str]) -> None:
    # No workload fingerprint: nothing says which workload it was meant for.
    Policy(mode=_tuned_mode()).save(_paths.config_path_for(script))
    script.write_text(SCRIPT_TEXT.format(lr="1e-3"))
    mp = advisor.load_policy(device="cpu")
    _train(mp, lr=1e-3)
    assert mp.mode == _tuned_mode() and warnings == []


@pytest.mark.parametrize("named", ["argument", "environment"])
def test_a_config_file_named_by_the_user_is_checked_against_the_model_only(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str], named: str
) -> None:
    config = _tuned_policy(script, _tuned_mode()).save(script.with_name("chosen.toml"))
    script.write_text(SCRIPT_TEXT.format(lr="1e-3"))
    if named == "environment":
        monkeypatch.setenv("MPADVISE_POLICY", str(config))
        mp = advisor.load_policy(device="cpu")
    else:
        mp = advisor.load_policy(config, device="cpu")
    _train(mp, lr=1e-3)
    assert mp.mode == _tuned_mode() and warnings == []


def test_a_config_file_named_by_the_user_still_checks_the_model(script: Path, warnings: list[str]) -> None:
    config = _tuned_policy(script, _tuned_mode()).save(script.with_name("chosen.toml"))
    mp = advisor.load_policy(config, device="cpu")
    wider = Net(hidden=64)
    mp.setup(wider, torch.optim.AdamW(wider.parameters(), lr=1e-5))
    assert mp.mode == _safe_default() and len(warnings) == 1 and "model changed since tuning" in warnings[0]
