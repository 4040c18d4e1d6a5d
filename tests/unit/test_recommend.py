"""The recommendation cache in use: record a tune, find it from load_policy(), and never apply
it where it no longer holds (other hardware, other versions, another script, another model).

Every test points MPADVISE_HOME at its own directory. Read-only cache directories are
simulated with a path below a regular file, because the tests run as root, which ignores file
modes.
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fakes import Net, gpu_profile
from torch import nn

import advisor
import probes
from advisor import _paths
from advisor._paths import database_path
from advisor.cache import _store as _cache
from advisor.cache._recommend import (
    entry_status,
    lookup,
    nothing_cached_yet,
    record_tune,
)
from advisor.runtime._workload import model_signature
from policies import Policy, TunedOn, safe_default_mode

GIB = 1024**3
WORKLOAD = "0123456789abcdef"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A training script that load_policy() believes it runs in, without arguments."""
    path = tmp_path / "project" / "train.py"
    path.parent.mkdir()
    path.write_text("print('training')\n")
    monkeypatch.setattr(_paths, "current_script", lambda: path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    return path


def _tuned_workload(model: nn.Module, batch: int | None = 64) -> str:
    """The workload fingerprint a tune of this script records for ``model`` (AdamW, lr 1e-3)."""
    mp = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    if batch is not None:
        mp.micro_batch_size(batch)
    assert mp.workload_fingerprint is not None
    return mp.workload_fingerprint


def _record(
    profile: probes.HardwareProfile,
    script: Path,
    *,
    mode: str = "bf16-mixed",
    workload: str = WORKLOAD,
    signature: str | None = None,
    **policy_fields: object,
) -> int:
    policy = Policy(mode=mode, tuned_on=TunedOn(model_signature=signature), **policy_fields)
    trials = [
        {"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 100.0},
        {"number": 1, "mode": mode, "outcome": "ok", "verdict": "stable", "goodput": 180.0},
    ]
    recommendation_id = record_tune(
        profile=profile,
        policy=policy,
        script=str(script),
        workload_fingerprint=workload,
        trials=trials,
        speedup_vs_fp32=1.8,
        goodput=180.0,
    )
    assert recommendation_id is not None
    return recommendation_id


# -- record and look up -------------------------------------------------------------------------


def test_record_then_lookup_hits_with_a_complete_tuned_on_record(script: Path) -> None:
    profile = gpu_profile("A100")
    recommendation_id = _record(profile, script, signature="aaaaaaaaaaaaaaaa", micro_batch_size=32)
    hit = lookup(profile, script)
    assert hit is not None
    policy, label = hit
    assert policy == Policy(mode="bf16-mixed", micro_batch_size=32)
    assert label.startswith(f"cache entry #{recommendation_id} (tuned 20")
    tuned = policy.tuned_on
    assert tuned is not None
    assert tuned.hardware_fingerprint == probes.hardware_fingerprint(profile)
    assert tuned.device == profile.name and tuned.torch == profile.torch_version
    assert dict(tuned.libraries) == dict(profile.libraries)
    assert (tuned.model_signature, tuned.workload_fingerprint) == ("aaaaaaaaaaaaaaaa", WORKLOAD)
    assert (tuned.speedup_vs_fp32, tuned.trials, tuned.script) == (1.8, 2, str(script))
    with _cache.Store() as store:
        row = store.get(recommendation_id)
    assert row is not None
    assert row["versions"] == {
        "torch": profile.torch_version, "torchao": "0.10.0", "transformer_engine": "2.1.0"
    }
    assert row["summary"]["trial_count"] == 2 and row["summary"]["device"] == profile.name
    assert row["summary"]["model_signature"] == "aaaaaaaaaaaaaaaa"
    assert [trial["mode"] for trial in row["trials"]] == ["fp32", "bf16-mixed"]
    # The stored profile travels in exports: no per-card identifiers.
    assert "uuid" not in row["hardware"] and row["hardware"]["name"] == profile.name


def test_record_rejects_a_trial_key_the_store_does_not_keep(script: Path) -> None:
    with pytest.raises(advisor.MpadviseError, match="trials\\[0\\] has unknown field 'loss'"):
        record_tune(
            profile=gpu_profile("A100"), policy=Policy(mode="fp32"), script=script,
            workload_fingerprint=WORKLOAD, trials=[{"loss": 1.0}], speedup_vs_fp32=None,
            goodput=None,
        )


def _changed(profile: probes.HardwareProfile, library: str, version: str) -> probes.HardwareProfile:
    libraries = dict(profile.libraries)
    libraries[library] = version
    return replace(profile, libraries=tuple(sorted(libraries.items())))


MISSES = {
    "gpu model": lambda p: replace(p, name="NVIDIA A100-PCIE-80GB"),
    "compute capability": lambda p: replace(p, compute_capability=(8, 6)),
    "memory sku": lambda p: replace(p, memory_total=40 * GIB),
    "cuda runtime": lambda p: replace(p, cuda_runtime="12.1"),
    "torch": lambda p: replace(p, torch_version="2.6.0+cu124"),
}
# Routine upgrades that do not change a non-FP8 answer (FP8 answers: test_cache_workload.py).
HITS = {
    "driver": lambda p: replace(p, driver_version="535.104.05"),
    "torch patch release": lambda p: replace(p, torch_version="2.5.2+cu124"),
    "torchao": lambda p: _changed(p, "torchao", "0.11.0"),
    "transformer_engine": lambda p: _changed(p, "transformer_engine", "2.2.0"),
    "transformer_engine removed": lambda p: _changed(p, "transformer_engine", None),
}


@pytest.mark.parametrize("change", sorted(MISSES))
def test_the_key_misses_when_the_hardware_or_a_version_changes(script: Path, change: str) -> None:
    tuned_on = gpu_profile("A100")
    _record(tuned_on, script)
    assert lookup(tuned_on, script) is not None  # the control: same machine hits
    assert lookup(MISSES[change](tuned_on), script) is None


@pytest.mark.parametrize("change", sorted(HITS))
def test_the_key_survives_a_routine_upgrade(script: Path, change: str) -> None:
    tuned_on = gpu_profile("A100")
    _record(tuned_on, script)
    hit = lookup(HITS[change](tuned_on), script)
    assert hit is not None and hit[0].mode == "bf16-mixed"


def test_the_key_misses_for_another_script(script: Path, tmp_path: Path) -> None:
    profile = gpu_profile("A100")
    _record(profile, script)
    other = script.with_name("finetune.py")
    other.write_text("print('other')\n")
    assert lookup(profile, other) is None
    assert lookup(profile, None) is None


def test_per_card_facts_do_not_change_the_key(script: Path) -> None:
    profile = gpu_profile("A100")
    _record(profile, script)
    twin = replace(profile, uuid="GPU-another-card", index=3, memory_free=1 * GIB, clocks_mhz=(1100, 1410))
    assert lookup(twin, script) is not None


def test_an_exact_path_wins_over_a_newer_entry_with_the_same_name(tmp_path: Path) -> None:
    profile = gpu_profile("H100")
    mine, theirs, moved = (tmp_path / d / "train.py" for d in ("mine", "theirs", "moved"))
    for path in (mine, theirs, moved):
        path.parent.mkdir()
        path.write_text("print()\n")
    _record(profile, mine, mode="bf16-mixed", workload="1" * 16)
    _record(profile, theirs, mode="fp8-te", workload="2" * 16)  # newer
    mine_hit, theirs_hit, moved_hit = (lookup(profile, p) for p in (mine, theirs, moved))
    assert mine_hit is not None and mine_hit[0].mode == "bf16-mixed"
    assert theirs_hit is not None and theirs_hit[0].mode == "fp8-te"
    # A script with no entry of its own misses: the same name in another folder is another
    # workload (its code, data and arguments may differ).
    assert moved_hit is None


def test_a_lookup_creates_no_cache_and_warns_nothing(script: Path, home: Path, warnings: list[str]) -> None:
    assert nothing_cached_yet(database_path())
    assert lookup(gpu_profile("A100"), script) is None
    assert not home.exists()
    assert warnings == []


def test_a_lookup_costs_milliseconds(script: Path) -> None:
    profile = gpu_profile("A100")
    for index in range(50):
        _record(profile, script.with_name(f"other{index}.py"), workload=f"{index:016x}")
    _record(profile, script)
    timings = []
    for _ in range(30):
        started = time.perf_counter()
        assert lookup(profile, script) is not None
        timings.append(time.perf_counter() - started)
    # Typically 1 to 2 ms on the 2-core build machine; scripts/bench_lookup.py measures it
    # end to end. The bound leaves room for a loaded CI machine.
    assert statistics.median(timings) < 0.050


def test_entry_status_names_what_changed(script: Path) -> None:
    before = gpu_profile("A100")
    _record(before, script)
    upgraded = replace(before, torch_version="2.6.0+cu124")
    with _cache.Store() as store:
        (row,) = store.list_recommendations()
    assert entry_status(row, before) is None
    assert row["hardware_fp"] == probes.hardware_fingerprint(before)
    assert "torch 2.5.1+cu124 -> 2.6.0+cu124" in entry_status(row, upgraded).describe()  # type: ignore[union-attr]
    reason = entry_status(row, gpu_profile("H100")).describe()  # type: ignore[union-attr]
    assert "device NVIDIA A100-SXM4-80GB -> NVIDIA H100 80GB HBM3" in reason


def test_record_without_a_usable_cache_returns_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: Path, warnings: list[str]
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "a-file" / "home"))
    result = record_tune(
        profile=gpu_profile("A100"), policy=Policy(mode="bf16-mixed"), script=script,
        workload_fingerprint=WORKLOAD, trials=[], speedup_vs_fp32=None, goodput=None,
    )
    assert result is None
    assert len(warnings) == 1 and "continuing without the cache" in warnings[0]


# -- load_policy() with the cache ---------------------------------------------------------------


def _cpu() -> probes.HardwareProfile:
    return probes.cpu_profile()


def _safe_default() -> str:
    return safe_default_mode(_cpu())[0]


def _tuned_mode() -> str:
    # A mode that differs from the safe default, so that which one applies is visible.
    return "bf16-mixed" if _safe_default() != "bf16-mixed" else "fp16-mixed"


def test_resolution_order_config_file_then_cache_then_safe_default(script: Path) -> None:
    _record(_cpu(), script, mode=_tuned_mode())
    config = _paths.config_path_for(script)
    Policy(mode="fp32").save(config)
    applied = advisor.load_policy(device="cpu")
    assert applied.source == f"config file {config}" and applied.mode == "fp32"
    config.unlink()
    applied = advisor.load_policy(device="cpu")
    assert applied.source.startswith("cache entry #1 (tuned ") and applied.mode == _tuned_mode()
    with _cache.Store() as store:
        store.clear()
    applied = advisor.load_policy(device="cpu")
    assert applied.source.startswith("safe default") and applied.mode == _safe_default()


def test_an_explicit_policy_skips_the_cache(script: Path) -> None:
    _record(_cpu(), script, mode=_tuned_mode())
    applied = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    assert applied.mode == "fp32" and "cache" not in applied.source


def test_an_entry_from_another_torch_is_not_applied(script: Path) -> None:
    _record(replace(_cpu(), torch_version="1.0.0"), script, mode=_tuned_mode())
    applied = advisor.load_policy(device="cpu")
    assert applied.mode == _safe_default() and applied.source.startswith("safe default")


def test_same_model_keeps_the_tuned_policy(script: Path, warnings: list[str]) -> None:
    model = Net()
    _record(_cpu(), script, mode=_tuned_mode(), signature=model_signature(model), workload=_tuned_workload(Net(), None))
    mp = advisor.load_policy(device="cpu")
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert mp.mode == _tuned_mode() and warnings == []


def test_changed_model_warns_once_and_uses_the_safe_default(script: Path, warnings: list[str]) -> None:
    _record(
        _cpu(), script, mode="bf16-true", signature=model_signature(Net(hidden=32)),
        workload=_tuned_workload(Net(hidden=32), None),
    )
    mp = advisor.load_policy(device="cpu")
    assert mp.mode == "bf16-true"
    model = Net(hidden=64)
    model, _ = mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert mp.mode == _safe_default() and mp.policy.tuned_on is None
    # The switch happened before the conversion: bf16-true would have cast the weights.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(warnings) == 1
    assert "model changed since tuning" in warnings[0] and "run `mpadvise tune` again" in warnings[0]
    assert f"using the safe default {_safe_default()}" in warnings[0]
    mp.setup(Net(hidden=64))
    assert len(warnings) == 1
    x = mp.to_device(torch.randn(8, 16))
    with mp.autocast():
        loss = model(x).square().mean()
    mp.step(loss, torch.optim.SGD(model.parameters(), lr=0.1))


def test_changed_model_inside_the_context_restores_the_switches(script: Path) -> None:
    _record(_cpu(), script, mode="bf16-true", signature="ffffffffffffffff")
    before = (torch.get_default_dtype(), torch.get_float32_matmul_precision())
    with advisor.load_policy(device="cpu") as mp:
        mp.setup(Net())
        assert mp.mode == _safe_default()
    assert (torch.get_default_dtype(), torch.get_float32_matmul_precision()) == before


def test_another_optimizer_is_another_workload(script: Path) -> None:
    def fingerprint(make_optimizer: object) -> str | None:
        mp = advisor.load_policy(Policy(mode="fp32"), device="cpu")
        model = Net()
        mp.setup(model, make_optimizer(model.parameters()))  # type: ignore[operator]
        mp.micro_batch_size(64)
        return mp.workload_fingerprint

    adamw = fingerprint(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert adamw is not None and adamw == fingerprint(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert adamw != fingerprint(lambda ps: torch.optim.SGD(ps, lr=1e-3))
    assert adamw != fingerprint(lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    assert adamw != fingerprint(lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6))


def test_a_corrupt_database_costs_a_warning_not_the_run(
    script: Path, home: Path, warnings: list[str]
) -> None:
    home.mkdir()
    database_path().write_bytes(b"this is not a database" * 100)
    applied = advisor.load_policy(device="cpu")
    assert applied.mode == _safe_default()
    assert len(warnings) == 1
    assert str(database_path()) in warnings[0] and ".corrupt-" in warnings[0]
    assert any(path.name.startswith("mpadvise.db.corrupt-") for path in home.iterdir())


def test_an_unusable_cache_directory_warns_once_and_uses_the_safe_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: Path, warnings: list[str]
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "a-file" / "home"))
    for _ in range(3):
        applied = advisor.load_policy(device="cpu")
        assert applied.mode == _safe_default()
    assert len(warnings) == 1
    assert "continuing without the cache" in warnings[0] and "MPADVISE_HOME" in warnings[0]


def test_an_entry_whose_mode_cannot_run_here_is_skipped_with_a_warning(
    script: Path, warnings: list[str]
) -> None:
    # tf32 needs an Ampere GPU: an entry for it on this CPU's key can only come from an
    # mpadvise whose support table differed.
    _record(_cpu(), script, mode="tf32")
    applied = advisor.load_policy(device="cpu")
    assert applied.mode == _safe_default() and applied.source.startswith("safe default")
    assert len(warnings) == 1 and "mode tf32 cannot run on" in warnings[0]


def test_a_hand_damaged_row_costs_a_warning_not_the_run(script: Path, warnings: list[str]) -> None:
    _record(_cpu(), script, mode=_tuned_mode())
    with sqlite3.connect(database_path()) as conn:
        conn.execute("UPDATE recommendations SET policy = '{not json'")
    applied = advisor.load_policy(device="cpu")
    assert applied.mode == _safe_default()
    assert len(warnings) == 1 and "continuing without the cache" in warnings[0]
