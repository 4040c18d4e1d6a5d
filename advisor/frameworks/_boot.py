"""``python -m advisor.frameworks._boot FRAMEWORK SCRIPT [ARGS...]``: run an unmodified framework
script with a policy applied through the framework's own settings: the trial candidate (steps
recorded through the framework's hooks) or, under ``mpadvise run``, the resolved config file.
"""

from __future__ import annotations

import os
import runpy
import sys

import probes
from advisor._log import get_logger
from advisor.frameworks._plan import MODULE, RUN_POLICY_ENV, RUN_SOURCE_ENV
from advisor.frameworks._registry import framework_class, framework_names, refusal
from advisor.frameworks._torch import PlainTorch, watch_run
from advisor.trial import (
    EXIT_UNSUPPORTED,
    end_trial_process,
    install_excepthook,
    recorder_for,
    seed_everything,
    spec_from_env,
    trial_candidate,
)
from policies import load_config
from probes import MpadviseError


def main(argv: list[str]) -> None:
    names = framework_names()
    if len(argv) < 2 or argv[0] not in names:
        sys.stderr.write(f"usage: python -m {MODULE} {{{','.join(names)}}} SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    framework, script, args = argv[0], argv[1], argv[2:]
    spec = spec_from_env()
    recorder = None
    if spec is not None:
        recorder = recorder_for(spec)
        install_excepthook(recorder.writer)
        # The device is left to the adapter, which checks what the framework really built there
        # (the HF Trainer's fp16 on a CPU ends unsupported once its Accelerator shows fp32).
        policy = trial_candidate(spec, recorder.writer, profile=probes.profile_for(spec.device),
                                 refusal=lambda p: refusal(p, framework))
        if policy is None:
            end_trial_process(EXIT_UNSUPPORTED)
        seed_everything(spec.seed)
        recorder.start()
        get_logger().info(f"trial {spec.label or policy.describe()} through {framework}")
    else:
        path = os.environ.get(RUN_POLICY_ENV)
        if not path:
            sys.stderr.write(f"error: {MODULE} needs a trial spec or {RUN_POLICY_ENV}; run it through mpadvise run\n")
            raise SystemExit(2)
        try:
            policy = load_config(path)
        except MpadviseError as exc:
            sys.stderr.write(f"error: {exc}\n")
            raise SystemExit(1) from None
        get_logger().info(f"policy {policy.describe()} through {framework} (from {os.environ.get(RUN_SOURCE_ENV) or path})")
    framework_class(framework).install(policy, recorder=recorder, device=None if spec is None else spec.device)
    if recorder is None and framework != PlainTorch.name:
        watch_run(policy)  # the plain adapter's install wires the guard into its own step hooks
    # As `python SCRIPT ARGS`: the script is __main__, its directory first on sys.path.
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
