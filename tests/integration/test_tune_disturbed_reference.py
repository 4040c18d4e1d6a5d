"""A neighbour's job started during the fp32 reference does not change the tune's answer.

``known_speedup.py`` does half the arithmetic under any 16-bit mode, a speed-up that holds on
any CPU under any steady load. One tune runs undisturbed; another starts four CPU-bound
processes beside the fp32 reference from its tenth step (the burst that once made a reference
7x slower and a candidate "17x faster"). Each must end on what its paired runs show: bf16-mixed
resolved faster than fp32, or fp32 on a gap the pairs left unresolved (the machine's own load
can leave one so: in a run of the suite beside two CPU-bound processes, eight pairs gave 0.79x to
3.34x), never a figure from unpaired runs. Where both pick bf16-mixed, their paired intervals
must overlap.
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

    for tune in (undisturbed, disturbed):
        assert _as_paired(tune), (_decision(undisturbed), _decision(disturbed))
    if undisturbed["winner_label"] == disturbed["winner_label"] == "bf16-mixed":
        speedup, interval = disturbed["speedup"], undisturbed["speedup"]
        # Both paired intervals must overlap: on a machine that other jobs load (CI's, the suite's
        # own), two pairs give wide intervals, and the undisturbed tune's own figure can be the one
        # off (1.42x against 1.87x once, the truth here being about 1.8x); a disturbed reference
        # decided on single runs lands far outside either (17x once).
        assert speedup["low"] <= interval["high"] and interval["low"] <= speedup["high"], (
            speedup, interval, disturbed["disturbed"])
    # what the report says about the reference: each of its runs the machine disturbed is named
    for event in disturbed["disturbed"]:
        assert event["kind"] in ("spread", "lost") and event["text"].startswith(event["label"])


def _as_paired(tune: dict) -> bool:
    """Whether a tune's answer is what its paired runs show: bf16-mixed with a paired interval
    above 1 over two pairs or more, or fp32 on a gap to bf16-mixed the pairs left unresolved
    (and said so). Never fp32 resolved faster (half the arithmetic cannot be slower), never a
    speed-up from single runs."""
    speedup, gap = tune["speedup"] or {}, tune.get("gap") or {}
    if tune["winner_label"] == "bf16-mixed":
        return (speedup.get("basis", "").startswith("paired re-measurement") and speedup.get("pairs", 0) >= 2
                and speedup.get("low") is not None and speedup["low"] > 1.0)
    return (tune["winner_label"] == "fp32" and gap.get("verdict") == "unresolved"
            and "the safer fp32 wins the tie" in (tune.get("tie_note") or ""))


def _decision(tune: dict) -> dict:
    """What decided a tune, for a failure message: its winner, speed-up, tie note, how
    re-measurement stopped, each finalist's rounds, and every disturbance it saw."""
    return {"winner": tune["winner_label"], "speedup": tune["speedup"], "tie_note": tune.get("tie_note"),
            "stop": tune.get("remeasure_stop"), "rounds": {f["label"]: f.get("rounds") for f in tune.get("finalists", [])},
            "disturbed": [event["text"] for event in tune.get("disturbed", [])]}
