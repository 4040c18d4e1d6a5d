"""Cold against warm trials, side by side and interleaved: what a trial's start-up costs, and what
the demo's tune takes end to end.

(a) One small trial of each bundled example, started cold (``MPADVISE_WARM_TRIALS=0``: a fresh
    interpreter imports torch and the script's framework) and warm (forked from a server that
    imported them once), alternating, for a few rounds: wall time and the share of it spent
    before the first optimizer step ended (``advisor.trial.startup_seconds``).
(b) The README demo's tune (``python -m advisor.cli tune examples/mlp.py --trials 12 --json``,
    as ``make demo`` runs it), cold and warm alternating: wall time, the ratio of medians, and
    whether both found the same winner.

Prints a table and writes JSON (default ``docs/bench/launch.json``).

    .venv/bin/python scripts/bench_launch.py [--rounds 3] [--tune-repeats 3] [--only mlp cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_agreement import machine  # beside this script, in scripts/

from probes import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Each example with arguments for a small trial (the trial ends the script after its window).
WORKLOADS: dict[str, tuple[str, list[str], str | None]] = {
    "mlp": ("mlp.py", ["--epochs", "1", "--samples", "2048"], None),
    "cnn": ("cnn.py", ["--epochs", "1", "--samples", "1024"], None),
    "tiny_lm": ("tiny_lm.py", ["--steps", "60"], None),
    "lightning_mlp": ("lightning_mlp.py", ["--max-steps", "60", "--samples", "2048"], "lightning"),
    "fabric_mlp": ("fabric_mlp.py", ["--max-steps", "60", "--samples", "2048"], "fabric"),
    "hf_trainer": ("hf_trainer.py", ["--steps", "60"], "transformers"),
    "accelerate_mlp": ("accelerate_mlp.py", ["--steps", "60", "--samples", "2048"], "accelerate"),
}
WARMUP_STEPS, MEASURE_STEPS = 3, 10
DEMO = ["tune", "examples/mlp.py", "--trials", "12", "--json"]


@contextlib.contextmanager
def switch(cold: bool) -> Iterator[None]:
    """Trials in this block start cold (``MPADVISE_WARM_TRIALS=0``) or may be forked."""
    from advisor.trial import WARM_ENV

    before = os.environ.get(WARM_ENV)
    os.environ[WARM_ENV] = "0" if cold else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(WARM_ENV, None)
        else:
            os.environ[WARM_ENV] = before


def one_trial(runner: Any, label: str) -> dict[str, Any]:
    """One fp32 trial; its wall time, start-up and phases."""
    from advisor.trial import breakdown, startup_seconds
    from policies import Policy

    result = runner(Policy(mode="fp32"), label)
    startup = startup_seconds(result.timeline)
    return {
        "outcome": result.outcome,
        "reason": result.reason if result.outcome != "ok" else "",
        "wall_s": round(result.wall_s, 3),
        "startup_s": None if startup is None else round(startup, 3),
        "startup_share": None if startup is None or not result.wall_s else round(startup / result.wall_s, 3),
        "phases": breakdown(result.timeline),
        "final_loss": result.losses[-1] if result.losses else None,
    }


def small_trials(names: list[str], rounds: int) -> dict[str, Any]:
    """(a): per example, a warm server started by one uncounted trial, then cold and warm
    trials alternating for ``rounds`` rounds."""
    from advisor.frameworks import plan_for
    from advisor.tune import ScriptRunner, TrialSettings

    rows: dict[str, Any] = {}
    for name in names:
        script, args, framework = WORKLOADS[name]
        plan = plan_for(EXAMPLES / script, framework)
        settings = TrialSettings(warmup_steps=WARMUP_STEPS, measure_steps=MEASURE_STEPS, framework=plan.framework,
                                 timeout=900)
        with ScriptRunner(EXAMPLES / script, args, settings, launch=plan.launch) as runner:
            start = time.perf_counter()
            with switch(cold=False):
                first = one_trial(runner, f"{name} first warm")
            first["server_and_trial_s"] = round(time.perf_counter() - start, 3)
            cold, warm = [], []
            for r in range(rounds):
                order = [(True, cold), (False, warm)] if r % 2 == 0 else [(False, warm), (True, cold)]
                for is_cold, out in order:
                    with switch(cold=is_cold):
                        out.append(one_trial(runner, f"{name} {'cold' if is_cold else 'warm'} {r}"))
            forked = runner.warm.forked
        rows[name] = {"first_warm": first, "cold": cold, "warm": warm, "forked": forked,
                      "cold_reason": runner.warm.last_cold_reason, **summary(cold, warm)}
        print_row(name, rows[name])
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summary(cold: list[dict[str, Any]], warm: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of wall time and start-up share, and the cold/warm ratio of wall medians."""
    out: dict[str, Any] = {}
    for kind, runs in (("cold", cold), ("warm", warm)):
        out[f"{kind}_wall_median_s"] = _median([r["wall_s"] for r in runs])
        out[f"{kind}_startup_median_s"] = _median([r["startup_s"] for r in runs])
        out[f"{kind}_startup_share_median"] = _median([r["startup_share"] for r in runs])
        out[f"{kind}_ok"] = all(r["outcome"] == "ok" for r in runs)
    c, w = out["cold_wall_median_s"], out["warm_wall_median_s"]
    out["wall_ratio_cold_over_warm"] = round(c / w, 2) if c and w else None
    out["same_losses"] = len({json.dumps(r["final_loss"]) for r in cold + warm}) == 1
    return out


def print_row(name: str, row: dict[str, Any]) -> None:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    print(f"{name:15s} cold {row['cold_wall_median_s']:7.2f} s (start-up {pct(row['cold_startup_share_median'])})"
          f"  warm {row['warm_wall_median_s']:7.2f} s (start-up {pct(row['warm_startup_share_median'])})"
          f"  x{row['wall_ratio_cold_over_warm']}  forked {row['forked']}  same loss {row['same_losses']}"
          f"  ok {row['cold_ok'] and row['warm_ok']}", flush=True)


def demo_tune(cold: bool, home: Path, extra: list[str]) -> dict[str, Any]:
    """One run of the demo's tune in a subprocess, in a fresh cache directory."""
    from advisor.trial import WARM_ENV

    env = {**os.environ, "MPADVISE_HOME": str(home), WARM_ENV: "0" if cold else "1", "COLUMNS": "200"}
    out = home / "mlp.mpadvise.toml"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *DEMO, *extra, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    winner, why = None, {}
    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, AttributeError):
        data = json.loads(proc.stdout)
        winner = (data.get("winner") or {}).get("mode")
        # Why it won: its paired speed-up, the decisive gap, the rounds and any tie it took; and
        # what the tune cost, in trial-equivalents.
        why = {"speedup": data.get("speedup"), "gap": data.get("gap"), "tie_note": data.get("tie_note"),
               "remeasure_rounds": data.get("remeasure_rounds"), "remeasure_stop": data.get("remeasure_stop"),
               "cost": data.get("cost"),
               "finalists": [f.get("label") for f in data.get("finalists") or []],
               "rounds": {f.get("label"): f.get("rounds") or [] for f in data.get("finalists") or []},
               "disturbed": [e.get("text") for e in data.get("disturbed") or []]}
    run = {"cold": cold, "wall_s": round(wall, 2), "exit_code": proc.returncode, "winner": winner, **why,
           "stderr_tail": proc.stderr[-400:] if proc.returncode not in (0, 3) else ""}
    return {**run, "pair_scatter": pair_scatter([run])} if "rounds" in why else run


def round_deviations(rounds: dict[str, list[float | None]]) -> list[float]:
    """Each re-measurement round's log ratio of a finalist to fp32 in the same round, less the
    median of that finalist's: how far one round strays (0 when every round gives the same
    ratio). ``rounds`` holds each finalist's goodput per round, by label. Empty when there is no
    fp32, or no rival with two paired rounds."""
    fp32 = next((r for label, r in rounds.items() if label and label.startswith("fp32")), None)
    deviations: list[float] = []
    for own in rounds.values() if fp32 is not None else ():
        if own is fp32:
            continue
        logs = [math.log(x / y) for x, y in zip(own, fp32) if x and y]
        if len(logs) >= 2:
            centre = statistics.median(logs)
            deviations.extend(abs(v - centre) for v in logs)
    return deviations


def pair_scatter(runs: list[dict[str, Any]]) -> float | None:
    """The median of ``round_deviations`` over every round of the given tunes (their
    ``rounds``) at once; ``None`` when there are none."""
    deviations = [d for r in runs for d in round_deviations(r.get("rounds") or {})]
    return round(statistics.median(deviations), 4) if deviations else None


def tunes(repeats: int, extra: list[str]) -> dict[str, Any]:
    """(b): the demo's tune, cold and warm alternating."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="mpadvise-bench-launch-") as tmp:
        for r in range(repeats):
            for cold in ((True, False) if r % 2 == 0 else (False, True)):
                run = demo_tune(cold, Path(tmp) / f"{r}-{'cold' if cold else 'warm'}", extra)
                runs.append(run)
                print(f"demo tune {'cold' if cold else 'warm'} {r}: {run['wall_s']:.1f} s, winner {run['winner']}, "
                      f"exit {run['exit_code']}, pair scatter {run.get('pair_scatter')}", flush=True)
    cold = [r["wall_s"] for r in runs if r["cold"]]
    warm = [r["wall_s"] for r in runs if not r["cold"]]
    c, w = statistics.median(cold), statistics.median(warm)
    winners = {("cold" if r["cold"] else "warm"): r["winner"] for r in runs}
    return {"command": ["mpadvise", *DEMO, *extra], "runs": runs, "cold_median_s": round(c, 2), "warm_median_s": round(w, 2),
            "ratio_cold_over_warm": round(c / w, 2),
            "winners_cold": [r["winner"] for r in runs if r["cold"]],
            "winners_warm": [r["winner"] for r in runs if not r["cold"]],
            "same_winner": len({r["winner"] for r in runs}) == 1, "last_winner": winners,
            "pair_scatter_cold": pair_scatter([r for r in runs if r["cold"]]),
            "pair_scatter_warm": pair_scatter([r for r in runs if not r["cold"]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="cold/warm rounds per example")
    parser.add_argument("--tune-repeats", type=int, default=3, help="cold/warm pairs of the demo's tune")
    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="these examples only")
    parser.add_argument("--skip-tune", action="store_true", help="only the small trials")
    parser.add_argument("--skip-trials", action="store_true", help="only the demo's tune")
    parser.add_argument("--tune-extra", default="", help="more tune options, e.g. --tune-extra=--no-priors")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "launch.json")
    options = parser.parse_args()
    os.environ.setdefault("MPADVISE_HOME", tempfile.mkdtemp(prefix="mpadvise-bench-home-"))
    report: dict[str, Any] = {"machine": machine(), "rounds": options.rounds,
                              "window": {"warmup_steps": WARMUP_STEPS, "measure_steps": MEASURE_STEPS}}
    if not options.skip_trials:
        report["small_trials"] = small_trials(options.only or list(WORKLOADS), options.rounds)
    if not options.skip_tune:
        report["demo_tune"] = tunes(options.tune_repeats, options.tune_extra.split())
        t = report["demo_tune"]
        print(f"demo tune: cold {t['cold_median_s']} s, warm {t['warm_median_s']} s, x{t['ratio_cold_over_warm']}, "
              f"same winner {t['same_winner']} (cold {t['winners_cold']}, warm {t['winners_warm']}), "
              f"round scatter cold {t['pair_scatter_cold']}, warm {t['pair_scatter_warm']}")
    report["machine"]["load_average_after"] = os.getloadavg()
    options.out.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(options.out, json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
