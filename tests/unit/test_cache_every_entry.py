"""The cache holds one answer per (hardware, workload): a run applies the one tuned on its
workload, whichever entry for this script is the newest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _as_script import run_as
from fakes import Net

import advisor
import probes
from advisor import _paths
from advisor.cache._recommend import record_tune
from advisor.runtime._workload import script_digest
from policies import Policy, TunedOn, safe_default_mode

SCRIPT_TEXT = "optimizer = AdamW(net.parameters(), lr=float(sys.argv[1]))\n"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home



@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "project" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT_TEXT)
    return path


def _cpu() -> probes.HardwareProfile:
    return probes.cpu_profile()


def _safe_default() -> str:
    return safe_default_mode(_cpu())[0]


def _train(mp: advisor.AppliedPolicy, lr: str, *, batch: int = 64, batch_first: bool = False) -> None:
    model = Net()
    if batch_first:
        mp.micro_batch_size(batch)
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=float(lr)))
    mp.micro_batch_size(batch)


def _tuned(script: Path, monkeypatch: pytest.MonkeyPatch, mode: str, lr: str, *, batch: int = 64) -> Policy:
    """The policy a tune of ``python script lr`` records."""
    run_as(monkeypatch, script, lr)
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _train(trial, lr, batch=batch)
    return Policy(mode=mode, tuned_on=TunedOn(
        model_signature=trial.model_signature, global_batch=batch, script_digest=script_digest(script),
        workload_fingerprint=trial.workload_fingerprint,
    ))


def _record(script: Path, monkeypatch: pytest.MonkeyPatch, mode: str, lr: str, *, batch: int = 64) -> int:
    policy = _tuned(script, monkeypatch, mode, lr, batch=batch)
    assert policy.tuned_on is not None and policy.tuned_on.workload_fingerprint
    recommendation_id = record_tune(profile=_cpu(), policy=policy, script=script,
                                    workload_fingerprint=policy.tuned_on.workload_fingerprint,
                                    trials=[], speedup_vs_fp32=1.5, goodput=150.0)
    assert recommendation_id is not None
    return recommendation_id


def test_an_older_entry_for_this_workload_applies(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    older = _record(script, monkeypatch, "bf16-mixed", "1e-5")
    _record(script, monkeypatch, "fp16-mixed", "1e-3")  # the newest entry: another workload
    run_as(monkeypatch, script, "1e-5")
    mp = advisor.load_policy(device="cpu")
    _train(mp, "1e-5")
    assert mp.mode == "bf16-mixed" and mp.source.startswith(f"cache entry #{older} ")
    assert warnings == []
    run_as(monkeypatch, script, "1e-3")
    mp = advisor.load_policy(device="cpu")
    _train(mp, "1e-3")
    assert mp.mode == "fp16-mixed" and warnings == []


def test_no_entry_for_this_workload_names_what_changed_since_the_newest(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    _record(script, monkeypatch, "bf16-mixed", "1e-5")
    _record(script, monkeypatch, "fp16-mixed", "1e-3")
    run_as(monkeypatch, script, "1e-2")
    mp = advisor.load_policy(device="cpu")
    _train(mp, "1e-2")
    assert mp.mode == _safe_default() and len(warnings) == 1
    assert "arguments: 1e-2)" in warnings[0] and "instead of fp16-mixed (dynamic loss scale 65536) from cache entry #2" in warnings[0]


def test_the_batch_asked_before_setup_chooses_among_the_entries(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    # The script reads its batch from somewhere else than its arguments: only the batch differs.
    _record(script, monkeypatch, "bf16-mixed", "1e-5", batch=64)
    _record(script, monkeypatch, "fp16-mixed", "1e-5", batch=128)
    run_as(monkeypatch, script, "1e-5")
    mp = advisor.load_policy(device="cpu")
    _train(mp, "1e-5", batch=64, batch_first=True)
    assert mp.mode == "bf16-mixed" and warnings == []


def test_a_tuned_config_file_for_another_workload_gives_way_to_the_cache(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    # A tune writes beside the script too: the file holds the latest tune, the cache every one.
    older = _record(script, monkeypatch, "bf16-mixed", "1e-5")
    _tuned(script, monkeypatch, "fp16-mixed", "1e-3").save(_paths.config_path_for(script))
    run_as(monkeypatch, script, "1e-5")
    mp = advisor.load_policy(device="cpu")
    _train(mp, "1e-5")
    assert mp.mode == "bf16-mixed" and mp.source.startswith(f"cache entry #{older} ") and warnings == []
