"""``mpadvise run``: a cached answer applies to a framework script only while the script is the
one that was tuned (the model, which ``setup()`` would check, does not exist yet)."""

from __future__ import annotations

import logging

import pytest

import probes
from advisor._load import PolicySource, resolve_policy
from advisor._log import get_logger
from advisor.cache._recommend import TunedAnswer, record_tune
from advisor.cache._store import Store
from advisor.cli import _run
from advisor.runtime._workload import script_digest
from policies import Policy, TunedOn


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("from transformers import Trainer\n")
    return path


def _cached(policy: Policy):
    return lambda profile, script: (policy, "cache entry #1 (tuned 2026-12-01)")


def test_a_cached_answer_applies_while_the_script_is_unchanged(script, monkeypatch):
    profile = probes.profile_for("cpu")
    tuned = Policy(mode="bf16-mixed", tuned_on=TunedOn(hardware_fingerprint=probes.hardware_fingerprint(profile),
                                                       torch=profile.torch_version, script_digest=script_digest(script)))
    monkeypatch.setattr(_run, "cached_answers", _cached(tuned))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    resolution = _run.tuned_for_run(script, None, profile)
    assert resolution.policy.mode == "bf16-mixed" and resolution.source.startswith("cache entry #1")
    assert resolution.kind is PolicySource.CACHE


class _Lines(logging.Handler):
    """The mpadvise logger's lines, whatever stream its own handler writes to."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_an_edited_script_gets_the_safe_default_with_a_warning(script, monkeypatch):
    profile = probes.profile_for("cpu")
    tuned = Policy(mode="fp16-mixed", tuned_on=TunedOn(hardware_fingerprint=probes.hardware_fingerprint(profile),
                                                       torch=profile.torch_version, script_digest=script_digest(script)))
    script.write_text("from transformers import Trainer  # edited\n")
    monkeypatch.setattr(_run, "cached_answers", _cached(tuned))
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    lines = _Lines()
    logger = get_logger()
    logger.addHandler(lines)
    try:
        resolution = _run.tuned_for_run(script, None, profile)
    finally:
        logger.removeHandler(lines)
    assert resolution.source.startswith("safe default") and resolution.kind is PolicySource.SAFE_DEFAULT
    assert any("train.py was edited since it was tuned" in line for line in lines.lines)


def test_the_config_file_a_tune_wrote_is_checked_like_the_cache(script, monkeypatch):
    # `mpadvise tune` writes its answer beside the script as well, where run finds it first.
    profile = probes.profile_for("cpu")
    tuned = Policy(mode="bf16-mixed", tuned_on=TunedOn(hardware_fingerprint=probes.hardware_fingerprint(profile),
                                                       torch=profile.torch_version, workload_fingerprint="0123456789abcdef",
                                                       script_digest=script_digest(script)))
    tuned.save(script.with_name("train.mpadvise.toml"))
    monkeypatch.setattr(_run, "cached_answers", lambda profile, script: None)
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    assert _run.tuned_for_run(script, None, profile).policy.mode == "bf16-mixed"
    script.write_text("from transformers import Trainer  # edited\n")
    assert _run.tuned_for_run(script, None, profile).source.startswith("safe default")
    # A file written by hand (no workload fingerprint) is applied as written.
    Policy(mode="bf16-mixed").save(script.with_name("train.mpadvise.toml"))
    assert _run.tuned_for_run(script, None, profile).policy.mode == "bf16-mixed"


def test_an_older_entry_tuned_on_this_content_applies(script, monkeypatch):
    # Tuned, edited and tuned again, then reverted: the first tune's entry is the one for it.
    profile = probes.profile_for("cpu")
    fingerprint = probes.hardware_fingerprint(profile)
    first = Policy(mode="bf16-mixed", tuned_on=TunedOn(hardware_fingerprint=fingerprint, torch=profile.torch_version,
                                                       workload_fingerprint="0123456789abcdef",
                                                       script_digest=script_digest(script)))
    second = Policy(mode="fp16-mixed", tuned_on=TunedOn(hardware_fingerprint=fingerprint, torch=profile.torch_version,
                                                        workload_fingerprint="fedcba9876543210",
                                                        script_digest="ffffffffffffffff"))
    answers = [TunedAnswer(second, "cache entry #2 (tuned 2026-12-02)"), TunedAnswer(first, "cache entry #1 (tuned 2026-12-01)")]
    monkeypatch.setattr(_run, "cached_answers", lambda profile, script: answers)
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    resolution = _run.tuned_for_run(script, None, profile)
    assert resolution.policy.mode == "bf16-mixed" and resolution.source.startswith("cache entry #1")
    script.write_text("from transformers import Trainer  # edited again\n")
    assert _run.tuned_for_run(script, None, profile).source.startswith("safe default")


def _record_with(script, profile, mode, args, workload):
    policy = Policy(mode=mode, tuned_on=TunedOn(model_signature="0123456789abcdef", global_batch=512,
                                                script_digest=script_digest(script), workload_fingerprint=workload))
    assert record_tune(profile=profile, policy=policy, script=script, workload_fingerprint=workload, trials=[],
                       speedup_vs_fp32=1.5, goodput=1.0, args=args) is not None


def test_a_cached_answer_applies_to_the_arguments_it_was_tuned_with(script, cache_home, monkeypatch):
    profile = probes.profile_for("cpu")
    _record_with(script, profile, "bf16-mixed", ["--width", "1024"], "1111111111111111")
    same = _run.tuned_for_run(script, None, profile, ["--width", "1024"])
    assert same.policy.mode == "bf16-mixed" and same.source.startswith("cache entry #1")
    lines = _Lines()
    get_logger().addHandler(lines)
    try:
        other = _run.tuned_for_run(script, None, profile, ["--width", "64"])
    finally:
        get_logger().removeHandler(lines)
    assert other.source.startswith("safe default")
    assert any("tuned with the arguments --width 1024, this run has --width 64" in line for line in lines.lines)


def test_the_config_file_a_tune_wrote_is_checked_against_its_arguments(script, cache_home):
    # The file carries no arguments; the cache entry of the same tune (same workload) does.
    profile = probes.profile_for("cpu")
    _record_with(script, profile, "bf16-mixed", ["--width", "1024"], "1111111111111111")
    with Store() as store:
        (row,) = store.find_recommendations()
    Policy.from_dict(row["policy"]).save(script.with_name("train.mpadvise.toml"))
    assert _run.tuned_for_run(script, None, profile, ["--width", "1024"]).source.startswith("config file")
    assert _run.tuned_for_run(script, None, profile, ["--width", "64"]).source.startswith("safe default")


def test_the_entry_tuned_with_these_arguments_applies(script, cache_home):
    profile = probes.profile_for("cpu")
    _record_with(script, profile, "bf16-mixed", ["--width", "1024"], "1111111111111111")
    _record_with(script, profile, "fp16-mixed", ["--width", "64"], "2222222222222222")
    assert _run.tuned_for_run(script, None, profile, ["--width", "1024"]).policy.mode == "bf16-mixed"
    assert _run.tuned_for_run(script, None, profile, ["--width", "64"]).policy.mode == "fp16-mixed"


def test_each_source_resolves_to_its_kind(script, tmp_path, monkeypatch):
    """One resolution, whichever caller asks: the kind says where the policy came from."""
    profile = probes.profile_for("cpu")
    monkeypatch.delenv("MPADVISE_POLICY", raising=False)
    named = tmp_path / "named.toml"
    Policy(mode="fp32").save(named)

    def kind(source=None, environ=None, cached=None):
        return resolve_policy(source, profile=profile, script=script, environ=environ or {}, cached=cached).kind

    assert kind(Policy(mode="fp32")) is PolicySource.EXPLICIT
    assert kind(named) is PolicySource.EXPLICIT
    assert kind(environ={"MPADVISE_POLICY": str(named)}) is PolicySource.ENV
    assert kind() is PolicySource.SAFE_DEFAULT
    assert kind(cached=_cached(Policy(mode="fp32"))) is PolicySource.CACHE
    Policy(mode="fp32").save(script.with_name("train.mpadvise.toml"))
    assert kind(cached=_cached(Policy(mode="bf16-mixed"))) is PolicySource.BESIDE_SCRIPT
    elsewhere = Policy(mode="fp32", tuned_on=TunedOn(hardware_fingerprint="0" * 16, device="NVIDIA H100", torch="2.4.0"))
    elsewhere.save(named)
    assert kind(named) is PolicySource.SAFE_DEFAULT  # tuned on other hardware: not applied
