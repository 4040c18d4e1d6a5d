"""How far one rounding carries fp32 on each script, and the limits that sets: the table in
docs/stability.md, "Calibration to the workload".

For each script it runs `mpadvise trial SCRIPT -m bf16-mixed -m bf16-true -m fp16-mixed --json`
(fp32, its perturbed replicate, the candidates) and prints fp32's smoothed curve, where the
replicate ended, the final and progress spreads, the limits they set, and each candidate's
verdict with its gap. Run from the repository root:

    .venv/bin/python scripts/bench_spread.py [--json OUT] [SCRIPT[:STEPS] ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from probes import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [
    "examples/mlp.py",
    "examples/cnn.py",
    "examples/tiny_lm.py",
    "tests/integration/scripts/tiny_ok.py",
    "tests/verdicts/stall_bf16_small_lr.py",
    "tests/integration/scripts/regression_small_lr.py:300",
    "tests/integration/scripts/regression_to_zero.py",
    "tests/integration/scripts/noisy_small_drop.py:200",
]
MODES = ("bf16-mixed", "bf16-true", "fp16-mixed")


def run(script: str, steps: int | None) -> dict[str, Any]:
    """One `mpadvise trial --json` of ``script``; its JSON, with the wall time."""
    cmd = [sys.executable, "-m", "advisor.cli", "trial", script, "--json"]
    for mode in MODES:
        cmd += ["-m", mode]
    if steps:
        cmd += ["--steps", str(steps)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 3):
        raise SystemExit(f"{script}: mpadvise trial exited {done.returncode}: {done.stderr.strip()[-500:]}")
    data = json.loads(done.stdout)
    data["wall_s"] = time.perf_counter() - start
    data["command"] = " ".join(cmd[1:])
    return data


def row(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of one script: fp32's curve, the replicate's end, spreads, limits, candidates."""
    metrics = data["reference"]["verdict"]["metrics"]
    candidates = []
    for ev in data["candidates"]:
        m = (ev.get("verdict") or {}).get("metrics") or {}
        candidates.append({"mode": ev["mode"], "outcome": ev["outcome"], "steps": ev["steps"],
                           "final_gap": m.get("final_gap"), "progress_ratio": m.get("progress_ratio")})
    return {
        "script": _relative(data["script"]), "steps": len(data["reference"]["losses"]),
        "reference_start": metrics.get("reference_start"), "reference_end": metrics.get("reference_end"),
        "replicate_end": metrics.get("replicate_end"), "final_spread": metrics.get("final_spread"),
        "progress_spread": metrics.get("progress_spread"), "final_gap_limit": metrics.get("final_gap_limit"),
        "progress_limit": None if metrics.get("reference_flat") else metrics.get("progress_limit", 0.9),
        "window_note": data.get("window_note", ""), "candidates": candidates, "wall_s": data["wall_s"],
        "command": data["command"],
    }


def _relative(script: str) -> str:
    path = Path(script)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else script


def _pct(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1%}"


def _num(value: Any) -> str:
    return "-" if value is None else f"{float(value):.4g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="*", default=SCRIPTS, help="SCRIPT or SCRIPT:STEPS")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    for item in args.scripts:
        script, _, steps = item.partition(":")
        rows.append(row(run(script, int(steps) if steps else None)))
        r = rows[-1]
        cands = "; ".join(
            f"{c['mode']} {c['outcome']} ({c['steps']} steps, gap {_pct(c['final_gap'])}, progress {_pct(c['progress_ratio'])})"
            for c in r["candidates"])
        print(f"| `{r['script']}` | {r['steps']} | {_num(r['reference_start'])} -> {_num(r['reference_end'])} | "
              f"{_num(r['replicate_end'])} | {_pct(r['final_spread'])} | {_pct(r['progress_spread'])} | "
              f"{_pct(r['final_gap_limit'])} / {_pct(r['progress_limit']) if r['progress_limit'] is not None else 'not judged'} | "
              f"{cands} |", flush=True)
    if args.json:
        write_file_atomic(args.json, json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
