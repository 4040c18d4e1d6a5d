"""The number of processes is part of the workload: an answer tuned on two processes is
measured at twice the per-process batch, so it fits neither one process nor eight.

The world size comes from ``torch.distributed`` when a group is initialised, else from
``WORLD_SIZE`` (torchrun sets it in every process); the global batch is the per-process batch
times the world size. A single process keys as it always did, so every cache entry written
before the world size was recorded reads as one process.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fakes import Net

import advisor
import probes
from advisor import _paths
from advisor.runtime import AppliedPolicy, Workload
from advisor.runtime._workload import (
    WORLD_SIZE,
    current_world_size,
    script_digest,
    workload_mismatch,
)
from policies import Policy, TunedOn

CPU = probes.cpu_profile()


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "train.py"
    path.write_text("optimizer = AdamW(net.parameters(), lr=1e-5)\n")
    monkeypatch.setattr(_paths, "current_script", lambda: path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return path


def _workload(world_size: int, per_process: int = 32, lr: float = 1e-5) -> Workload:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return Workload.of(model, optimizer, global_batch=per_process * world_size, script=None, world_size=world_size)


def _tuned_on(workload: Workload, per_process: int = 32, **recorded: object) -> TunedOn:
    """``[tuned_on]`` as a tune writes it: its global batch is the script's batch per process."""
    return TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(CPU), device=CPU.name,
        workload_fingerprint=workload.fingerprint(), model_signature=workload.model,
        global_batch=per_process, **recorded,  # type: ignore[arg-type]
    )


# ---- where the world size comes from -----------------------------------------------------------


def test_the_world_size_comes_from_the_environment_torchrun_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert current_world_size() == 1
    assert current_world_size({"WORLD_SIZE": "8"}) == 8
    assert current_world_size({"WORLD_SIZE": "nonsense"}) == 1  # not torchrun's: one process
    assert current_world_size({"WORLD_SIZE": "0"}) == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert current_world_size() == 4


def test_an_initialised_process_group_is_asked_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert current_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert current_world_size() == 4


def test_a_workload_reads_the_world_size_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Workload.of(Net(), None, global_batch=64, script=None).world_size == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert Workload.of(Net(), None, global_batch=64, script=None).world_size == 1


# ---- the fingerprint ---------------------------------------------------------------------------


def test_the_world_size_changes_the_fingerprint_even_at_the_same_global_batch() -> None:
    one = _workload(1, per_process=64)
    two = _workload(2, per_process=32)
    assert one.global_batch == two.global_batch == 64
    assert one.fingerprint() != two.fingerprint()
    assert _workload(8).fingerprint() not in (one.fingerprint(), two.fingerprint())


def test_one_process_keys_as_before_the_world_size_was_recorded() -> None:
    """A cache entry written before has no world size: read as one process, it still hits."""
    one = _workload(1)
    assert one.world_size == 1
    assert Workload(one.model, one.optimizer, one.groups, one.global_batch, None, None).fingerprint() == one.fingerprint()


def test_a_world_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        replace(_workload(1), world_size=0)


# ---- what changed since tuning -----------------------------------------------------------------


@pytest.mark.parametrize(("tuned", "here"), [(2, 8), (2, 1), (1, 2)])
def test_another_world_size_misses_naming_both(tuned: int, here: int) -> None:
    mismatch = workload_mismatch(_tuned_on(_workload(tuned)), _workload(here))
    assert mismatch is not None
    what = {d.what: (d.tuned, d.here) for d in mismatch.differences}
    assert what[WORLD_SIZE] == (str(tuned), str(here))
    assert what["global batch"] == (str(32 * tuned), str(32 * here))
    assert mismatch.unrecorded == ()
    assert f"world size {tuned} -> {here}" in mismatch.reason()


def test_the_same_global_batch_on_another_world_size_names_the_world_size_alone() -> None:
    mismatch = workload_mismatch(_tuned_on(_workload(2, per_process=32)), _workload(1, per_process=64))
    assert mismatch is not None
    assert mismatch.reason() == "workload changed since tuning (world size 2 -> 1)"


def test_the_same_world_size_fits() -> None:
    assert workload_mismatch(_tuned_on(_workload(2)), _workload(2)) is None
    assert workload_mismatch(_tuned_on(_workload(1)), _workload(1)) is None


def test_a_world_size_the_tune_recorded_is_taken_as_recorded() -> None:
    """Once ``[tuned_on]`` carries ``world_size``, it is read rather than recovered."""
    tuned = _tuned_on(_workload(2))
    recorded = type("Recorded", (), {**{f: getattr(tuned, f) for f in tuned.__dataclass_fields__}, "world_size": 2})()
    mismatch = workload_mismatch(recorded, _workload(4))  # type: ignore[arg-type]
    assert mismatch is not None and "world size 2 -> 4" in mismatch.reason()


def test_another_world_size_and_other_optimizer_settings_say_both() -> None:
    mismatch = workload_mismatch(_tuned_on(_workload(2)), _workload(4, lr=1e-3))
    assert mismatch is not None
    assert WORLD_SIZE in mismatch.unrecorded
    assert "; 4 processes; arguments: none)" in mismatch.detail()


# ---- applied ------------------------------------------------------------------------------------


def _tune_at(world_size: int, monkeypatch: pytest.MonkeyPatch, per_process: int = 32) -> Policy:
    """An answer tuned with ``world_size`` processes, as a trial of this script records it."""
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    model = Net()
    trial.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    trial.micro_batch_size(per_process)
    assert trial.world_size == world_size and trial.global_batch == per_process * world_size
    script = _paths.current_script()
    return Policy(mode="bf16-mixed", tuned_on=TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(CPU), device=CPU.name,
        workload_fingerprint=trial.workload_fingerprint, model_signature=trial.model_signature,
        global_batch=per_process, script_digest=script_digest(script),
    ))


@pytest.mark.parametrize("here", [1, 8])
def test_an_answer_tuned_on_two_processes_falls_back_on_another_count(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str], here: int
) -> None:
    policy = _tune_at(2, monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", str(here))
    mp = AppliedPolicy(policy, profile=CPU, source="cache entry #1", device="cpu", match_workload=True)
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    assert mp.policy.tuned_on is None
    assert len(warnings) == 1 and f"world size 2 -> {here}" in warnings[0]
    assert mp.micro_batch_size(32) == 32 and mp.global_batch == 32 * here


def test_an_answer_tuned_on_two_processes_applies_on_two(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    policy = _tune_at(2, monkeypatch)
    mp = AppliedPolicy(policy, profile=CPU, source="cache entry #1", device="cpu", match_workload=True)
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    assert mp.micro_batch_size(32) == 32
    assert mp.policy is policy and warnings == []
    assert mp.workload_fingerprint == policy.tuned_on.workload_fingerprint


def test_the_global_batch_counts_every_process(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    mp = AppliedPolicy(Policy(mode="fp32", micro_batch_size=8), profile=CPU, source="test", device="cpu")
    assert mp.micro_batch_size(32) == 8
    assert (mp.grad_accum_steps, mp.world_size, mp.global_batch) == (4, 2, 64)


def test_one_process_with_other_optimizer_settings_says_nothing_of_processes() -> None:
    mismatch = workload_mismatch(_tuned_on(_workload(1)), _workload(1, lr=1e-3))
    assert mismatch is not None and WORLD_SIZE not in mismatch.unrecorded
    assert "processes" not in mismatch.detail()
