"""`mpadvise trial` beside a CPU-bound neighbour: its trials run on the cores left.

With torch on every core and one of them taken, every op waits at its barrier for the thread the
scheduler put aside: on 2 cores examples/mlp.py's step went from 3.8 ms to 280 ms, and fp32 and
bf16-mixed measured alike. The trial now reads the cores before each run, and from the first
that finds one taken runs torch on the cores left, and says so. A real neighbour, real trials.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_a_trial_beside_a_neighbour_runs_on_the_cores_left(isolated_home, cli):
    # Enough neighbours that the cores left are fewer than torch's own threads (1 on 2 cores).
    count = max(1, len(os.sched_getaffinity(0)) - torch.get_num_threads() + 1)
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        proc = cli("trial", str(SCRIPTS / "tiny_ok.py"), "-m", "bf16-mixed", "--steps", "32", "--warmup", "2",
                   "--json", timeout=600)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert proc.returncode in (0, 3), proc.stderr
    data = json.loads(proc.stdout)
    (event, *_) = [e for e in data["disturbed"] if e["kind"] == "busy-cpu"]
    assert event["label"] == "fp32" and event["threads"] >= 1  # seen before the reference ran
    assert "cores busy" in event["text"] and f"ran on {event['threads']} thread" in event["text"]
    assert {run["threads"] for run in [data["reference"], *data["candidates"]]} == {event["threads"]}
    assert data["candidates"][0]["speedup_vs_fp32"] is not None
