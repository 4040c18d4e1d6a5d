"""A neighbour's job started during the fp32 reference does not change the tune's answer.

``known_speedup.py`` does half the arithmetic under any 16-bit mode, a speed-up that holds on
any CPU under any steady load. One tune runs undisturbed; another starts four CPU-bound
processes beside the fp32 reference from its tenth step (the burst that once made a reference
7x slower and a candidate "17x faster"). Both must pick the same winner, and the disturbed
tune's paired interval must overlap the undisturbed tune's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TUNE = ("-m", "fp32", "-m", "bf16-mixed", "--no-priors", "--json", "--no-cache")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "known_speedup.py", path)
    return path


def test_a_disturbed_reference_gives_the_undisturbed_winner_and_speed_up(script, tmp_path, isolated_home, cli):
    quiet = cli("tune", str(script), *TUNE, timeout=900)
    assert quiet.returncode == 0, quiet.stderr
    undisturbed = json.loads(quiet.stdout)

    env = {**os.environ, "DISTURB_MARKER": str(tmp_path / "disturbed"), "MPADVISE_HOME": str(isolated_home)}
    busy = cli("tune", str(script), *TUNE, "--fresh", timeout=900, env=env)  # the first tune's study is deleted on purpose
    assert busy.returncode == 0, busy.stderr
    disturbed = json.loads(busy.stdout)
    assert (tmp_path / "disturbed").exists()  # the neighbour did start during the reference

    assert undisturbed["winner_label"] == disturbed["winner_label"] == "bf16-mixed", (_decision(undisturbed),
                                                                                      _decision(disturbed))
    speedup, interval = disturbed["speedup"], undisturbed["speedup"]
    assert speedup["basis"].startswith("paired re-measurement") and interval["pairs"] >= 2
    # Both paired intervals must overlap: on a machine that other jobs load (CI's, the suite's
    # own), two pairs give wide intervals, and the undisturbed tune's own figure can be the one
    # off (1.42x against 1.87x once, the truth here being about 1.8x); a disturbed reference
    # decided on single runs lands far outside either (17x once).
    assert speedup["low"] <= interval["high"] and interval["low"] <= speedup["high"], (
        speedup, interval, disturbed["disturbed"])
    # what the report says about the reference: each of its runs the machine disturbed is named;
    # where other processes kept a core busy before a trial (CI's own neighbours), that is named too
    for event in disturbed["disturbed"]:
        assert event["kind"] in ("spread", "busy-cpu", "cpu-free") and event["text"].startswith(event["label"])


def _decision(tune: dict) -> dict:
    """What decided a tune, for a failure message: its winner, speed-up, tie note, how
    re-measurement stopped, each finalist's rounds, and every disturbance it saw."""
    return {"winner": tune["winner_label"], "speedup": tune["speedup"], "tie_note": tune.get("tie_note"),
            "stop": tune.get("remeasure_stop"), "rounds": {f["label"]: f.get("rounds") for f in tune.get("finalists", [])},
            "disturbed": [event["text"] for event in tune.get("disturbed", [])]}
