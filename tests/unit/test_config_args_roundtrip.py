"""The arguments a config file was tuned with: ``[tuned_on].args`` round-trips through TOML,
JSON and the cache; an older file without it still loads; a run with other arguments says so
in one warning that names both lists and the tune to run; and a fallback to the same mode
says it keeps that mode rather than "fp32 instead of fp32"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _as_script import run_as
from fakes import Net

import advisor
import probes
from advisor import _paths
from advisor.cache import Store, record_tune
from advisor.runtime._workload import script_digest
from policies import Policy, PolicyError, TunedOn, load_config, safe_default_mode

SCRIPT_TEXT = "optimizer = AdamW(net.parameters(), lr=1e-5)\n"


@pytest.fixture(autouse=True)
def home(cache_home: Path) -> Path:
    return cache_home



@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "project" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT_TEXT)
    run_as(monkeypatch, path)
    return path


def _train(mp: advisor.AppliedPolicy, *, batch: int = 64) -> None:
    model = Net()
    mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    mp.micro_batch_size(batch)


def _tuned_policy(script: Path, mode: str, args: tuple[str, ...] | None) -> Policy:
    """The policy ``mpadvise tune`` writes beside the script, tuned with ``args``."""
    trial = advisor.load_policy(Policy(mode="fp32"), device="cpu")
    _train(trial)
    profile = probes.cpu_profile()
    return Policy(mode=mode, tuned_on=TunedOn(
        hardware_fingerprint=probes.hardware_fingerprint(profile), device=profile.name,
        torch=profile.torch_version or "", workload_fingerprint=trial.workload_fingerprint,
        model_signature=trial.model_signature, global_batch=64, script=str(script),
        script_digest=script_digest(script), args=args,
    ))


@pytest.mark.parametrize("args", [(), ("--epochs", "1"), ("a b", "--x=it's")])
def test_args_round_trip_through_toml_and_json(tmp_path: Path, args: tuple[str, ...]) -> None:
    policy = Policy(mode="bf16-mixed", tuned_on=TunedOn(workload_fingerprint="ab" * 8, args=args))
    path = policy.save(tmp_path / "train.mpadvise.toml")
    assert load_config(path).tuned_on.args == args
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))).tuned_on.args == args
    assert isinstance(load_config(path).tuned_on.args, tuple)


def test_a_config_without_args_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('schema = 1\nmode = "fp32"\n\n[tuned_on]\nworkload_fingerprint = "abababababababab"\n')
    assert load_config(path).tuned_on.args is None


@pytest.mark.parametrize("bad", ["300", [1, 2], {"a": "b"}])
def test_args_that_are_not_a_list_of_strings_are_refused(bad: object) -> None:
    with pytest.raises(PolicyError, match=r"tuned_on\.args"):
        Policy.from_dict({"mode": "fp32", "tuned_on": {"args": bad}}, source="x.toml")


def test_the_cache_keeps_the_args(tmp_path: Path) -> None:
    profile = probes.cpu_profile()
    policy = Policy(mode="fp32", tuned_on=TunedOn(workload_fingerprint="cd" * 8))
    with Store(tmp_path / "cache.db") as store:
        entry = record_tune(profile=profile, policy=policy, script=tmp_path / "train.py",
                            workload_fingerprint="cd" * 8, trials=[], speedup_vs_fp32=1.0, goodput=1.0,
                            store=store, args=["--epochs", "3"])
        stored = store.get(entry)
    assert Policy.from_dict(stored["policy"]).tuned_on.args == ("--epochs", "3")


def test_a_run_with_other_arguments_names_both_lists_and_the_tune(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    _tuned_policy(script, "fp32", ()).save(_paths.config_path_for(script))
    run_as(monkeypatch, script, "50")
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "script arguments (none) -> 50" in line
    assert f"`mpadvise tune {script} -- 50`" in line
    assert "optimizer settings or script arguments differ" not in line


def test_the_same_arguments_apply_without_a_warning(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    run_as(monkeypatch, script, "--epochs", "2")
    config = _tuned_policy(script, "fp32", ("--epochs", "2")).save(_paths.config_path_for(script))
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert warnings == [] and mp.source == f"config file {config}"


def test_other_arguments_found_before_setup_are_named_too(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    # micro_batch_size() before setup(): only the batch and the arguments are known yet.
    _tuned_policy(script, "fp32", ()).save(_paths.config_path_for(script))
    run_as(monkeypatch, script, "--big")
    mp = advisor.load_policy(device="cpu")
    mp.micro_batch_size(128)
    assert len(warnings) == 1, warnings
    assert "global batch 64 -> 128" in warnings[0] and "script arguments (none) -> --big" in warnings[0]
    assert "-- --big` tunes for these arguments" in warnings[0]


def test_a_fallback_to_the_same_mode_says_it_keeps_it(
    script: Path, monkeypatch: pytest.MonkeyPatch, warnings: list[str]
) -> None:
    default = safe_default_mode(probes.cpu_profile())[0]
    _tuned_policy(script, default, ()).save(_paths.config_path_for(script))
    run_as(monkeypatch, script, "50")
    mp = advisor.load_policy(device="cpu")
    _train(mp)
    assert mp.mode == default and len(warnings) == 1
    assert f"{default} instead of {default}" not in warnings[0]
    assert f"keeping {default} from config file" in warnings[0] and ": the safe default here" in warnings[0]


def test_a_tune_with_other_arguments_is_refused_in_one_line(tmp_path: Path) -> None:
    from advisor.tune._service import check_config_args
    from probes import UsageError

    config = Policy(mode="fp32", tuned_on=TunedOn(workload_fingerprint="ab" * 8, args=())).save(
        tmp_path / "train.mpadvise.toml")
    script = tmp_path / "train.py"
    check_config_args(config, script, [])  # the same arguments: replaced as before
    check_config_args(tmp_path / "absent.toml", script, ["300"])
    with pytest.raises(UsageError) as refused:
        check_config_args(config, script, ["300"])
    line = str(refused.value)
    assert "\n" not in line and refused.value.exit_code == 2
    assert "`train.py` (no arguments)" in line and "`train.py 300`" in line and "--out FILE" in line


def test_a_config_that_does_not_record_its_arguments_is_replaced_as_before(tmp_path: Path) -> None:
    from advisor.tune._service import check_config_args

    config = Policy(mode="fp32", tuned_on=TunedOn(workload_fingerprint="ab" * 8)).save(tmp_path / "t.toml")
    check_config_args(config, tmp_path / "train.py", ["300"])
