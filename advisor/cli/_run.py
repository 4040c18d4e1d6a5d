"""``mpadvise run train.py -- ARGS``: run a script with its tuned policy applied, unchanged.

A framework script (Lightning, the HF Trainer, Accelerate) runs under the framework adapter,
which applies the policy through the framework's own settings, as its trials did. A script
written against the loop API applies its policy itself (``load_policy()``), so it runs as
``python train.py ARGS`` with the chosen config file named in ``MPADVISE_POLICY``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import probes
from advisor._load import POLICY_ENV, PolicySource, Resolution, resolve_policy
from advisor._log import get_logger
from advisor._paths import config_path_for
from advisor.cache import TunedAnswer, cached_answers
from advisor.frameworks import RUN_POLICY_ENV, RUN_SOURCE_ENV, check_expressible, plan_for, refusal
from advisor.runtime import fallback_words, safe_fallback, script_digest
from advisor.tune import check_script
from policies import Policy, load_config
from probes import HardwareProfile, MpadviseError


def resolve_for_run(script: Path, config: Path | None, profile: HardwareProfile, args: Sequence[str] = ()) -> Resolution:
    """The policy ``mpadvise run`` applies: ``--config``, ``MPADVISE_POLICY``, the config beside
    the script, the cache, the safe default (the order ``load_policy()`` follows).

    The workload check that ``setup()`` makes for a tune's answer (cached, or the config file a
    tune wrote beside the script) cannot run before a framework builds the model, so here such
    an answer applies only to the script it was tuned on: the same content, and the same
    arguments ``args`` where the tune recorded them (``record_tune(args=...)``; an answer that
    does not say is judged on the content alone). Of the tunes' answers for this script, the
    first tuned on both applies; without one, ``safe_fallback`` applies (the safe default, or the
    tuned mode where that is safer), with a warning that says what differs.
    """
    resolution = resolve_policy(config, profile=profile, script=script, environ=os.environ, cached=cached_answers)
    if not resolution.match_workload:
        return resolution
    digest, here = script_digest(script), tuple(args)
    answers = [TunedAnswer(resolution.policy, resolution.source, resolution.args), *resolution.alternatives]
    for answer in answers:
        if not _differences(answer, digest, here, script):
            if answer.policy is resolution.policy:
                return resolution
            get_logger().info(f"using {answer.policy.describe()} from {answer.label}, tuned on this script and these arguments")
            # Only the first answer can be a config file's: the others are the cache's.
            return Resolution(answer.policy, answer.label, PolicySource.CACHE, match_workload=True, args=answer.args)
    fallback = safe_fallback(resolution.policy, profile)
    using, source = fallback_words(fallback, profile)
    get_logger().warning(
        f"not applying the policy from {resolution.source}: {'; '.join(_differences(answers[0], digest, here, script))}; "
        f"{using} for {profile.name}; run `mpadvise tune` again"
    )
    return Resolution(fallback, source, PolicySource.SAFE_DEFAULT)


def _differences(answer: TunedAnswer, digest: str | None, args: tuple[str, ...], script: Path) -> list[str]:
    """What tells this run of ``script`` from the one ``answer`` was tuned on, for people."""
    tuned = answer.policy.tuned_on
    differences = []
    if tuned is not None and tuned.script_digest not in (None, digest):
        differences.append(f"{script.name} was edited since it was tuned")
    if answer.args is not None and answer.args != args:
        differences.append(
            f"it was tuned with the arguments {shlex.join(answer.args) or '(none)'}, this run has {shlex.join(args) or '(none)'}"
        )
    return differences


def run_command(script: Path, script_args: list[str], *, config: Path | None, framework: str | None,
                device: str | None) -> int:
    """Run the script with its policy applied; returns the script's exit code."""
    path = check_script(script)
    if config is not None and not config.is_file():
        raise MpadviseError(f"config file {config} does not exist")
    plan = plan_for(path, framework)
    env = dict(os.environ)
    if plan.framework is None:
        # The script calls load_policy() itself: it resolves the same way, makes the workload
        # check at setup(), and logs its own line. A config file it would refuse (another
        # user's, or one others can write) is refused here first, in one line.
        _check_config_file(config, path)
        if config is not None:
            env[POLICY_ENV] = str(config.resolve())
        if device is not None:
            get_logger().warning("--device applies to framework scripts; a load_policy() script picks its own device")
        return _run([sys.executable, str(path), *script_args], env)
    profile = probes.profile_for(device)
    resolution = resolve_for_run(path, config, profile, script_args)
    policy = resolution.policy
    if resolution.kind is PolicySource.SAFE_DEFAULT and refusal(policy, plan.framework, device=profile.device) is not None:
        # mpadvise's own choice is a mode this framework lacks (pure bf16): fp32 is safe anywhere.
        policy = Policy(mode="fp32")
    check_expressible(policy, plan.framework, source=resolution.source, device=profile.device)
    # The child logs the one line naming the policy and its source, once it has applied it.
    with _policy_file(policy, config) as file:
        env[RUN_POLICY_ENV] = file
        env[RUN_SOURCE_ENV] = resolution.source
        return _run([sys.executable, *plan.launch, str(path), *script_args], env)


def _check_config_file(config: Path | None, script: Path) -> None:
    """Load the config file a ``load_policy()`` script would read (``--config``,
    ``MPADVISE_POLICY``, or the one beside the script), so that a bad or untrusted one is
    refused before the script starts. Raises ``PolicyError``."""
    named = str(config) if config is not None else os.environ.get(POLICY_ENV)
    path = Path(named) if named else config_path_for(script)
    if named or os.path.lexists(path):
        load_config(path)


class _policy_file:
    """The config file to hand to the child: ``config`` itself, or a private temporary copy."""

    def __init__(self, policy: Policy, config: Path | None) -> None:
        self.policy, self.config = policy, config
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> str:
        if self.config is not None:
            return str(self.config.resolve())
        self._tmp = tempfile.TemporaryDirectory(prefix="mpadvise-run-")
        return str(self.policy.save(Path(self._tmp.name) / "policy.mpadvise.toml"))

    def __exit__(self, *exc: object) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def _run(argv: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the child got the same Ctrl-C; let it finish its own way
        return proc.wait()
