"""The framework child's entry point ends a candidate its framework cannot apply, or that is no
policy at all, as ``unsupported`` with the reason, before the script runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor.frameworks._plan import launch_argv
from advisor.trial import TrialSpec, run_trial
from policies import Policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (Policy(mode="bf16-true").to_dict(), "transformers cannot apply mode bf16-true (it can apply fp32, tf32"),
        ({"mode": "nonsense"}, "trial spec: mode: 'nonsense' is not allowed"),
    ],
)
def test_a_candidate_that_cannot_run_is_unsupported_before_the_script_runs(tmp_path, policy, reason):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"from transformers import Trainer\nopen({str(marker)!r}, 'w').close()\n")
    spec = TrialSpec(policy=policy, result_path=str(tmp_path / "result.json"), framework="transformers")
    result = run_trial(script, [], spec, timeout=120, launch=launch_argv("transformers"))
    assert result.outcome == "unsupported" and reason in result.reason
    assert not marker.exists()
