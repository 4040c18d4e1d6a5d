"""``mpadvise run train.py -- ARGS``: run a script with its tuned policy applied, unchanged.

A framework script runs under its adapter, as its trials did; one that calls ``load_policy()``
runs as ``python train.py ARGS`` (``--config`` in ``MPADVISE_POLICY``). A framework script for
which nothing was tuned runs with its own settings: mpadvise applies only what was measured.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import probes
from advisor._load import POLICY_ENV, PolicySource, Resolution, after_guard_events, resolve_policy
from advisor._log import get_logger
from advisor._paths import config_path_for
from advisor.cache import TunedAnswer, cached_answers, guard_events_for
from advisor.cli._common import bad_value
from advisor.frameworks import RUN_POLICY_ENV, RUN_SOURCE_ENV, check_expressible, plan_for, refusal
from advisor.runtime import GUARD_ENV, fallback_words, guard_setting, safe_fallback, script_digest
from advisor.tune import check_script
from policies import Policy, load_config
from probes import HardwareProfile, UsageError


def tuned_for_run(script: Path, config: Path | None, profile: HardwareProfile,
                  args: Sequence[str] = ()) -> Resolution | None:
    """The policy ``mpadvise run`` applies, in ``load_policy()``'s order, or ``None`` when nothing
    was tuned for ``script``. ``setup()``'s workload check cannot run before a framework builds
    the model, so a tune's answer applies only to the same script content and recorded ``args``;
    else ``safe_fallback``, with a warning."""
    resolution = resolve_policy(config, profile=profile, script=script, environ=os.environ, cached=cached_answers)
    if resolution.kind is PolicySource.SAFE_DEFAULT and resolution.mismatch is None:
        return None  # resolve_policy found nothing at all: its hardware default is a guess
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
        tuned_args, run_args = shlex.join(answer.args) or "(none)", shlex.join(args) or "(none)"
        differences.append(f"it was tuned with the arguments {tuned_args}, this run has {run_args}")
    return differences


def run_command(script: Path, script_args: list[str], *, config: Path | None, framework: str | None,
                device: str | None, json_output: bool = False, guard: str | None = None) -> int:
    """Run the script with its policy applied; returns the script's exit code. With
    ``json_output``, one line of JSON follows the script's own output on stdout."""
    path = check_script(script)
    if config is not None:
        if not config.is_file():
            raise UsageError(f"--config: config file {config} does not exist")
        with bad_value():
            load_config(config)
    plan = plan_for(path, framework)
    env = dict(os.environ)
    with bad_value("--guard: "):  # a run under mpadvise is watched unless told otherwise
        env[GUARD_ENV] = guard_setting(guard if guard is not None else env.get(GUARD_ENV) or "warn")

    def summary(framework: str | None, policy: Policy | None, source: str,
                kind: PolicySource | None) -> dict[str, Any] | None:
        if not json_output:
            return None
        return {"script": str(path), "framework": framework,
                "policy": None if policy is None else policy.to_dict(), "source": source,
                "source_kind": None if kind is None else kind.value}

    if plan.framework is None:
        # The script calls load_policy() itself: it resolves the same way, makes the workload
        # check at setup(), and logs its own line. A config file it would refuse (another
        # user's, or one others can write) is refused here first, in one line.
        named = str(config) if config is not None else env.get(POLICY_ENV)
        beside = config_path_for(path)
        loaded = load_config(named or beside) if named or os.path.lexists(beside) else None
        if config is not None:
            env[POLICY_ENV] = str(config.resolve())
        if device is not None:
            get_logger().warning("--device applies to framework scripts; a load_policy() script "
                                 "picks its own device")
        # A config file named here is the one the script applies.
        source = f"config file {named}" if named else "load_policy() in the script"
        kind = None if not named else PolicySource.EXPLICIT if config else PolicySource.ENV
        return _run([sys.executable, str(path), *script_args], env,
                    summary(None, loaded if named else None, source, kind))
    profile = probes.profile_for(device)
    resolution = tuned_for_run(path, config, profile, script_args)
    if resolution is None:
        get_logger().warning(f"no tuned policy for {script}; running it with its own settings: "
                             f"mpadvise tune {script} first")
        return _run([sys.executable, str(path), *script_args], env,
                    summary(plan.framework, None, "none: the script's own settings", None))
    if config is None and resolution.kind is not PolicySource.ENV:
        # A long run under this policy that the guard saw go wrong: the mode it fell back to.
        resolution = after_guard_events(resolution, guard_events_for(profile, path))
    policy = resolution.policy
    if resolution.kind is PolicySource.SAFE_DEFAULT and refusal(policy, plan.framework, device=profile.device) is not None:
        # mpadvise's own choice is a mode this framework lacks (pure bf16): fp32 is safe anywhere.
        policy = Policy(mode="fp32")
    check_expressible(policy, plan.framework, source=resolution.source, device=profile.device)
    # The child logs the one line naming the policy and its source, once it has applied it.
    with _policy_file(policy, config) as file:
        env[RUN_POLICY_ENV] = file
        env[RUN_SOURCE_ENV] = resolution.source
        return _run([sys.executable, *plan.launch, str(path), *script_args], env,
                    summary(plan.framework, policy, resolution.source, resolution.kind))


@contextmanager
def _policy_file(policy: Policy, config: Path | None) -> Iterator[str]:
    """The config file to hand to the child: ``config`` itself, or a private temporary copy."""
    if config is not None:
        yield str(config.resolve())
        return
    with tempfile.TemporaryDirectory(prefix="mpadvise-run-") as directory:
        yield str(policy.save(Path(directory) / "policy.mpadvise.toml"))


def _run(argv: list[str], env: dict[str, str], summary: dict[str, Any] | None) -> int:
    """Run the script, its output passing through; then ``summary``, if any, as one line of JSON
    with ``exit_code`` and ``wall_s``."""
    started = time.monotonic()
    sys.stdout.flush()
    proc = subprocess.Popen(argv, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the child got the same Ctrl-C; let it finish its own way
        code = proc.wait()
    if summary is not None:
        wall = round(time.monotonic() - started, 3)
        sys.stdout.write(json.dumps({**summary, "exit_code": code, "wall_s": wall}, default=str) + "\n")
        sys.stdout.flush()
    return code
