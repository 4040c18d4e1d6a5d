"""A cached answer applies only to the workload and the hardware it was tuned on.

The workload: the model's structure, the optimizer and its precision-relevant hyperparameters,
the global batch, and the script (this very file, its content and its arguments). The hardware:
the device model, compute capability and the torch and CUDA release lines, plus the FP8
library for an FP8 answer. A routine driver upgrade or a torch patch release keeps the cache.

Entries are recorded as a tune records them: the workload fingerprint that the trial's
``AppliedPolicy`` computes, with the model signature, the script's global batch and the
script's digest in ``[tuned_on]``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _as_script import run_as
from fakes import Net, gpu_profile

import advisor
import probes
from advisor import _paths
from advisor._load import PolicySource, resolve_policy
from advisor._paths import database_path
from advisor.cache import _store as _cache
from advisor.cache._recommend import entry_status, lookup, record_tune
from advisor.runtime._workload import model_signature, script_digest
from policies import Policy, TunedOn, hardware_mismatch, safe_default_mode

SCRIPT_TEXT = "optimizer = AdamW(net.parameters(), lr={lr})\n"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home



@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "project" / "stall_small_lr.py"
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


def _train(
    mp: advisor.AppliedPolicy, *, lr: float = 1e-5, batch: int | None = 64, hidden: int = 32,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, batch_first: bool = False,
) -> None:
    """What a training script does with the policy object, up to its DataLoader."""
    model = Net(hidden)
    if batch_first and batch is not None:
        mp.micro_batch_size(batch)
    mp.setup(model, optimizer(model.parameters(), lr=lr))
    if not batch_first and batch is not None:
        mp.micro_batch_size(batch)


def _tune(script: Path, mode: str, *, lr: float = 1e-5, batch: int | None = 64, profile: probes.HardwareProfile | None = None) -> int:
    """Record an answer for this script as ``mpadvise tune`` would."""
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _train(trial, lr=lr, batch=batch)
    policy = Policy(mode=mode, tuned_on=TunedOn(
        model_signature=trial.model_signature, global_batch=batch, script_digest=script_digest(script),
    ))
    recommendation_id = record_tune(
        profile=profile or _cpu(), policy=policy, script=script, workload_fingerprint=trial.workload_fingerprint or "",
        trials=[], speedup_vs_fp32=1.5, goodput=150.0,
    )
    assert recommendation_id is not None
    return recommendation_id


# -- the workload -------------------------------------------------------------------------------


def test_the_same_workload_applies_the_cached_answer(script: Path, warnings: list[str]) -> None:
    _tune(script, _tuned_mode())
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == _tuned_mode() and mp.source.startswith("cache entry #1")
    assert warnings == []


def test_an_edited_learning_rate_misses_with_one_line_naming_it(script: Path, warnings: list[str]) -> None:
    _tune(script, _tuned_mode())
    script.write_text(SCRIPT_TEXT.format(lr="1e-3"))
    mp = advisor.load_policy(device="cpu")
    assert mp.mode == _tuned_mode()  # the model is not known yet
    _train(mp, lr=1e-3)
    assert mp.mode == _safe_default() and mp.source.startswith("safe default")
    assert len(warnings) == 1
    line = warnings[0]
    assert line.startswith("workload changed since tuning (script edited; ")
    assert "optimizer settings or script arguments differ (now AdamW(lr=0.001, " in line
    assert f"using the safe default {_safe_default()} instead of {_tuned_mode()}" in line
    assert "from cache entry #1 (tuned " in line


def test_an_edit_that_changes_nothing_else_is_named_alone(script: Path, warnings: list[str]) -> None:
    # The recorded facts explain the whole change: the optimizer and arguments are not blamed.
    _tune(script, _tuned_mode())
    script.write_text(script.read_text() + "# a comment\n")
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == _safe_default()
    assert len(warnings) == 1 and warnings[0].startswith("workload changed since tuning (script edited); ")


def test_other_arguments_miss_and_are_named(script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]) -> None:
    run_as(monkeypatch, script, "--lr", "1e-5")
    _tune(script, _tuned_mode())
    run_as(monkeypatch, script, "--lr", "1e-3")
    mp = advisor.load_policy(device="cpu")
    _train(mp, lr=1e-3)
    assert mp.mode == _safe_default()
    assert len(warnings) == 1
    assert "workload changed since tuning (optimizer settings or script arguments differ (now AdamW(lr=0.001" in warnings[0]
    assert "arguments: --lr 1e-3)" in warnings[0]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"optimizer": torch.optim.Adam}, "now Adam(lr=1e-05"),
        ({"lr": 1e-4}, "now AdamW(lr=0.0001"),
        ({"hidden": 64}, "model changed since tuning"),
    ],
    ids=["optimizer class", "learning rate", "model"],
)
def test_a_changed_optimizer_or_model_misses(
    script: Path, warnings: list[str], change: dict[str, object], named: str
) -> None:
    # The script's text stays the same: the change comes from elsewhere (a config file it reads).
    _tune(script, _tuned_mode())
    mp = advisor.load_policy(device="cpu")
    _train(mp, **change)  # type: ignore[arg-type]
    assert mp.mode == _safe_default()
    assert len(warnings) == 1 and named in warnings[0]


def test_a_script_of_the_same_name_in_another_folder_misses(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    _tune(script, _tuned_mode())
    copy = tmp_path / "elsewhere" / script.name
    copy.parent.mkdir()
    copy.write_text(script.read_text())
    run_as(monkeypatch, copy)
    assert lookup(_cpu(), copy) is None
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == _safe_default() and mp.source.startswith("safe default")
    assert lookup(_cpu(), script) is not None  # the tuned file itself still hits


def test_another_global_batch_before_setup_misses_and_keeps_the_batch(script: Path, warnings: list[str]) -> None:
    _tune(script, _tuned_mode(), batch=64)
    mp = advisor.load_policy(device="cpu")
    _train(mp, batch=128, batch_first=True)
    assert mp.mode == _safe_default()
    assert (mp.global_batch, mp.grad_accum_steps) == (128, 1)
    assert len(warnings) == 1 and "workload changed since tuning (global batch 64 -> 128)" in warnings[0]


def test_another_global_batch_after_setup_misses_while_the_model_is_unconverted(
    script: Path, warnings: list[str]
) -> None:
    # The tuned mode (autocast) did not touch the model: switching after setup() is safe.
    _tune(script, _tuned_mode(), batch=64)
    mp = advisor.load_policy(device="cpu")
    _train(mp, batch=128)
    assert mp.mode == _safe_default() and mp.global_batch == 128
    assert len(warnings) == 1 and "global batch 64 -> 128" in warnings[0]


def test_another_global_batch_after_a_conversion_keeps_the_mode_and_the_batch(
    script: Path, warnings: list[str]
) -> None:
    # bf16-true cast the weights in setup(): that cannot be undone, so the mode stays, on the
    # script's own global batch, and the one warning says so.
    _tune(script, "bf16-true", batch=64)
    mp = advisor.load_policy(device="cpu")
    _train(mp, batch=128)
    assert mp.mode == "bf16-true" and mp.global_batch == 128
    assert len(warnings) == 1
    assert "global batch 64 -> 128" in warnings[0] and "keeping bf16-true" in warnings[0]


def test_the_config_file_a_tune_wrote_checks_the_whole_workload(script: Path, warnings: list[str]) -> None:
    # `mpadvise tune` writes the cached policy beside the script too; it is read first, and
    # carries the workload fingerprint: an edited learning rate misses there as in the cache.
    _tune(script, _tuned_mode())
    with _cache.Store() as store:
        (row,) = store.find_recommendations()
    config = Policy.from_dict(row["policy"]).save(_paths.config_path_for(script))
    script.write_text(SCRIPT_TEXT.format(lr="1e-3"))
    mp = advisor.load_policy(device="cpu")
    _train(mp, lr=1e-3, batch=64)
    assert mp.mode == _safe_default()
    assert len(warnings) == 1 and "now AdamW(lr=0.001, " in warnings[0] and f"from config file {config}" in warnings[0]


# -- the hardware -------------------------------------------------------------------------------


def test_a_driver_upgrade_or_torch_patch_release_keeps_the_cache(script: Path, warnings: list[str]) -> None:
    tuned = gpu_profile("A100")
    _tune(script, "bf16-mixed", profile=tuned)
    for upgraded in (replace(tuned, driver_version="560.35.03"), replace(tuned, torch_version="2.5.2+cu124")):
        resolution = resolve_policy(None, profile=upgraded, script=script, environ={}, cached=lookup)
        assert resolution.policy.mode == "bf16-mixed" and resolution.kind is PolicySource.CACHE
    assert warnings == []


@pytest.mark.parametrize(("mode", "library"), [("fp8-torchao", "torchao"), ("fp8-te", "transformer_engine")])
def test_an_fp8_answer_needs_its_fp8_library_version(
    script: Path, warnings: list[str], mode: str, library: str
) -> None:
    tuned = gpu_profile("H100")
    _tune(script, mode, profile=tuned)
    libraries = dict(tuned.libraries)
    libraries[library] = "9.9.9"
    upgraded = replace(tuned, libraries=tuple(sorted(libraries.items())))
    assert probes.hardware_fingerprint(upgraded) == probes.hardware_fingerprint(tuned)
    resolution = resolve_policy(None, profile=upgraded, script=script, environ={}, cached=lookup)
    assert resolution.policy.mode == "bf16-mixed" and resolution.mismatch is not None
    assert resolution.mismatch.detail() == f"{library} {dict(tuned.libraries)[library]} -> 9.9.9"
    assert len(warnings) == 1 and f"{library} {dict(tuned.libraries)[library]} -> 9.9.9" in warnings[0]
    with _cache.Store() as store:
        (row,) = store.list_recommendations()
    reason = entry_status(row, upgraded).describe()  # type: ignore[union-attr]
    assert f"{library} {dict(tuned.libraries)[library]} -> 9.9.9" in reason
    # The other FP8 library is not this answer's concern.
    other = "transformer_engine" if library == "torchao" else "torchao"
    libraries = dict(tuned.libraries)
    libraries[other] = None
    assert hardware_mismatch(
        lookup(tuned, script)[0], replace(tuned, libraries=tuple(sorted(libraries.items())))  # type: ignore[index]
    ) is None


def test_a_new_release_line_is_named(script: Path) -> None:
    tuned = gpu_profile("A100")
    _tune(script, "bf16-mixed", profile=tuned)
    policy = lookup(tuned, script)[0]  # type: ignore[index]
    mismatch = hardware_mismatch(policy, replace(tuned, torch_version="2.6.0+cu126", cuda_runtime="12.6", driver_version="999"))
    assert mismatch is not None
    assert mismatch.detail() == "torch 2.5.1+cu124 -> 2.6.0+cu126; CUDA 12.4 -> 12.6"


def test_a_policy_recorded_under_fingerprint_recipe_1_still_applies_on_its_machine() -> None:
    profile = gpu_profile("A100")
    old = TunedOn(hardware_fingerprint=probes.hardware_fingerprint(profile, version=1), device=profile.name)
    assert hardware_mismatch(Policy(mode="bf16-mixed", tuned_on=old), profile) is None
    assert hardware_mismatch(Policy(mode="bf16-mixed", tuned_on=old), gpu_profile("H100")) is not None


# -- stored entries ------------------------------------------------------------------------------


def test_entries_keyed_by_recipe_1_are_migrated(home: Path, tmp_path: Path) -> None:
    """A cache written before recipe 2: entries that differed only by driver now share a key,
    and the newest answer for it is kept."""
    profile = gpu_profile("A100")
    old_driver = replace(profile, driver_version="535.104.05")
    script_path = str(tmp_path / "train.py")
    with _cache.Store() as store:
        for hardware, mode, workload in ((old_driver, "fp16-mixed", "1" * 16), (profile, "bf16-mixed", "1" * 16),
                                         (old_driver, "tf32", "2" * 16)):
            fingerprint = probes.hardware_fingerprint(hardware, version=1)
            store.put_hardware(fingerprint, hardware.to_dict())
            tuned = TunedOn(hardware_fingerprint=fingerprint, device=hardware.name, torch=hardware.torch_version or "")
            store.put_recommendation(
                hardware_fp=fingerprint, workload_fp=workload, script=script_path,
                policy=Policy(mode=mode, tuned_on=tuned).to_dict(), speedup_vs_fp32=1.2, goodput=1.0,
                versions={}, summary={}, trials=[{"number": 0, "mode": mode}],
            )
        store.put_hardware("ffffffffffffffff", {"kind": "cpu"})  # not a readable profile: left alone
    with sqlite3.connect(database_path()) as conn:
        # As a database written by the release before the migration: only m001 recorded.
        # Its tables are those m001 made: the later migrations' own tables did not exist yet.
        conn.execute("DELETE FROM _migrations WHERE name != 'm001_initial_schema'")
        conn.execute("DROP TABLE guard_events")
        conn.execute("PRAGMA user_version = 1")
    with _cache.Store() as store:
        rows = store.find_recommendations(with_trials=True)
        hardware = {row[0] for row in store.db.execute("SELECT fingerprint FROM hardware")}
    new = probes.hardware_fingerprint(profile)
    assert hardware == {new, "ffffffffffffffff"}
    assert sorted((row["workload_fp"], row["mode"]) for row in rows) == [("1" * 16, "bf16-mixed"), ("2" * 16, "tf32")]
    for row in rows:
        assert row["hardware_fp"] == new and row["policy"]["tuned_on"]["hardware_fingerprint"] == new
        assert [trial["mode"] for trial in row["trials"]] == [row["mode"]]
    with sqlite3.connect(database_path()) as conn:
        assert conn.execute("SELECT COUNT(*) FROM trials").fetchone()[0] == 2
    assert lookup(replace(profile, driver_version="999.0"), script_path) is not None


def test_a_model_signature_is_kept_by_record_tune(script: Path) -> None:
    _tune(script, _tuned_mode())
    policy = lookup(_cpu(), script)[0]  # type: ignore[index]
    tuned = policy.tuned_on
    assert tuned is not None and tuned.model_signature == model_signature(Net())
    assert (tuned.global_batch, tuned.script_digest) == (64, script_digest(script))
    assert tuned.cuda == (_cpu().cuda_runtime or "")


# -- the guard's yardstick ----------------------------------------------------------------------


def test_the_guard_measures_the_run_against_the_tunes_fp32_curve(script: Path, warnings: list[str]) -> None:
    # The tune keeps fp32's loss per optimizer step with its answer; a run of the same workload
    # that ends the steps they share well above it is named, from its last whole shared window.
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _train(trial)
    policy = Policy(mode=_tuned_mode(), tuned_on=TunedOn(
        model_signature=trial.model_signature, global_batch=64, script_digest=script_digest(script)))
    record_tune(profile=_cpu(), policy=policy, script=script, workload_fingerprint=trial.workload_fingerprint or "",
                trials=[], speedup_vs_fp32=1.5, goodput=150.0, reference_losses=[0.01] * 40)
    mp = advisor.load_policy(device="cpu", guard="warn")
    assert mp.guard.reference == (0.01,) * 40
    model = Net(32)
    model, optimizer = mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    mp.micro_batch_size(64)
    torch.manual_seed(0)
    for _ in range(60):
        with mp.autocast():
            loss = torch.nn.functional.cross_entropy(model(torch.randn(64, 16)).float(), torch.randint(0, 4, (64,)))
        mp.step(loss, optimizer)
    (event,) = mp.guard.events
    assert (event.signal, event.step, event.tripped_at) == ("behind fp32", 1, 25)
    assert "over steps 1-25, above fp32's upper quartile 0.01 in the tune" in event.detail
    assert [line for line in warnings if "guard: behind fp32 under" in line]
