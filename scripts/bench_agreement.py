"""Do `mpadvise trial`, `mpadvise tune` and a start-up-free measurement agree on one mode's speed?

For one script and one mode against fp32, three measurements of the same ratio (fp32's step
time over the mode's; above 1 when the mode is faster):

* **start-up free**: the script run plainly, a short and a long run of each mode, interleaved;
  the difference of their wall times over the difference of their steps is a step's time with
  imports, set-up and exit removed. Median over the repeats.
* **trial**: `mpadvise trial SCRIPT -m MODE --json`, run ``--trials`` times: the candidate's
  goodput over the fp32 reference's (single runs), or with ``--trial-pairs N`` its paired
  speed-up over N interleaved rounds (`trial --pairs N`). Median.
* **tune**: `mpadvise tune SCRIPT -m fp32 -m MODE --no-priors --json --no-cache` (and
  ``--tune-extra``), run ``--tunes`` times: the winner and the paired figure of MODE against
  fp32 (the winner's speed-up when MODE wins; one over fp32's paired gap over MODE when fp32
  wins).

Each tune and trial is also checked against the start-up-free ratio (within 10% is the bar).
The three kinds run interleaved, round by round, one of each kind per round in an order that
rotates (a start-up-free repeat, a trial, a tune; then a trial, a tune, a start-up-free
repeat; ...), so a spell of the host that changes the ratio for minutes falls on all three
alike rather than on whichever kind ran then. Prints a table and writes JSON (``--json``),
with each measurement's start time. ``--pool FILE...`` reads recorded runs instead and
compares every tune with the medians of all their start-up-free and trial figures together.
Presets name the bundled examples:

    .venv/bin/python scripts/bench_agreement.py mlp --mode bf16-mixed
    .venv/bin/python scripts/bench_agreement.py accelerate --mode bf16-mixed --width 256
    .venv/bin/python scripts/bench_agreement.py accelerate-known     # a known bf16 speed-up, any CPU
    .venv/bin/python scripts/bench_agreement.py --pool docs/bench/agreement-accelerate-amx*.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from probes import write_file_atomic

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Preset:
    """How to run one bundled example: its script, its arguments, how a plain run applies a
    mode, and how many optimizer steps a plain run of ``n`` units takes."""

    script: str
    args: tuple[str, ...]
    mode_args: dict[str, tuple[str, ...]]
    length_flag: str  # the flag that sets a plain run's length
    steps_per_unit: int  # optimizer steps per unit of that flag
    short: int = 1  # units of the short and the long plain run, unless --short/--long say
    long: int = 3


def presets(width: int) -> dict[str, Preset]:
    return {
        # 8192 samples at batch 128: 64 optimizer steps per epoch
        "mlp": Preset("examples/mlp.py", ("--width", str(width)),
                      {"fp32": (), "bf16-mixed": ("--mode", "bf16-mixed"), "bf16-true": ("--mode", "bf16-true")},
                      "--epochs", 64),
        "accelerate": Preset("examples/accelerate_mlp.py", ("--width", str(width)),
                             {"fp32": ("--mixed-precision", "no"), "bf16-mixed": ("--mixed-precision", "bf16")},
                             "--steps", 1, 100, 300),
        # An unmodified Accelerate script whose steps do half their fixed fp32 work under bf16:
        # a speed-up that holds on any CPU, AMX or not (--width does not apply).
        "accelerate-known": Preset("tests/integration/scripts/accelerate_known_speedup.py", (),
                                   {"fp32": ("--mixed-precision", "no"), "bf16-mixed": ("--mixed-precision", "bf16")},
                                   "--steps", 1, 100, 400),
    }


def cli(*args: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """``mpadvise ARGS --json``, decoded; in ``env`` when given, else this process's environment."""
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"mpadvise {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def plain_wall(preset: Preset, mode: str, units: int, home: str) -> float:
    """Seconds a plain run of ``units`` takes, under ``mode``, with no config or cache to find."""
    env = {**os.environ, "MPADVISE_HOME": home}
    env.pop("MPADVISE_POLICY", None)
    start = time.perf_counter()
    subprocess.run([sys.executable, preset.script, *preset.args, *preset.mode_args[mode], preset.length_flag,
                    str(units)], cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
    return time.perf_counter() - start


def startup_free_once(preset: Preset, mode: str, r: int, short: int, long: int, home: str) -> float:
    """fp32's step time over ``mode``'s, start-up removed: repeat ``r`` (the order of modes and
    lengths alternates with ``r``)."""
    steps = (long - short) * preset.steps_per_unit
    per_step = {}
    for m in (("fp32", mode) if r % 2 == 0 else (mode, "fp32")):
        walls = [plain_wall(preset, m, n, home) for n in ((short, long) if r % 2 == 0 else (long, short))]
        per_step[m] = abs(walls[1] - walls[0]) / steps
    return per_step["fp32"] / per_step[mode]


KINDS = ("startup_free", "trial", "tune")


def schedule(counts: dict[str, int]) -> list[tuple[str, int]]:
    """The order the measurements run in: ``(kind, index)``, round by round, one of each kind
    still owed per round, the kinds' order rotating by one each round."""
    order = []
    for r in range(max(counts.values(), default=0)):
        for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
            if r < counts.get(kind, 0):
                order.append((kind, r))
    return order


def trial_ratio(preset: Preset, mode: str, pairs: int = 0) -> float:
    """The trial's figure for MODE: one run of each, or its paired speed-up over ``pairs`` rounds."""
    data = cli("trial", preset.script, "-m", mode, "--pairs", str(pairs), "--json", "--", *preset.args, timeout=3600)
    if not pairs:
        return float(data["candidates"][0]["speedup_vs_fp32"])
    paired = data["pairs"]["candidates"]
    if not paired or paired[0]["speedup_vs_fp32"] is None:
        raise SystemExit(f"mpadvise trial --pairs {pairs}: {mode} was not paired with fp32 ({paired})")
    return float(paired[0]["speedup_vs_fp32"]["ratio"])


def tune_ratio(preset: Preset, mode: str, extra: tuple[str, ...] = ()) -> dict:
    """The tune's winner, and MODE's paired ratio to fp32 with its interval when paired;
    ``extra``: more tune options."""
    with tempfile.TemporaryDirectory() as home:
        os.environ["MPADVISE_HOME"] = home
        try:
            # The config file goes to the throwaway home, not beside the script in the checkout.
            data = cli("tune", preset.script, "-m", "fp32", "-m", mode, "--no-priors", "--json", "--no-cache",
                       "--out", os.path.join(home, "policy.mpadvise.toml"), *extra, "--", *preset.args, timeout=3600)
        finally:
            os.environ.pop("MPADVISE_HOME", None)
    winner = data.get("winner_label")
    ratio = low = high = None
    basis = ""
    if winner == mode and data.get("speedup"):
        ratio, low, high, basis = (data["speedup"].get(k) for k in ("ratio", "low", "high", "basis"))
    else:  # fp32 won: MODE's paired gap, inverted (the gap is the leader's lead over it)
        found = next((f for f in data.get("finalists") or [] if f["label"] == mode and f.get("gap_vs_leader")), None)
        row = next((r for r in data.get("candidates") or [] if r["label"] == mode), None)
        if found:
            gap = found["gap_vs_leader"]
            ratio = 1 / gap["ratio"]
            low = 1 / gap["high"] if gap.get("high") else None
            high = 1 / gap["low"] if gap.get("low") else None
            basis = f"fp32's paired lead, {gap['pairs']} pairs"
        elif row is not None and row.get("search_speedup_vs_fp32"):  # not a finalist: its one search run
            ratio, basis = row["search_speedup_vs_fp32"], "search run against the reference (not a finalist)"
    rows = {r["label"]: r for r in data.get("candidates") or []}
    return {"winner": winner, "ratio": ratio, "low": low, "high": high, "basis": basis,
            "disturbed": len(data.get("disturbed") or []), "wall_s": data.get("wall_s"),
            "cost": data.get("cost"), "flops_per_step": data.get("flops_per_step"),
            "utilisation": {label: {"tflops": rows[label].get("tflops"), "mfu": rows[label].get("mfu"),
                                    "mfu_dtype": rows[label].get("mfu_dtype")} for label in ("fp32", mode) if label in rows}}


def log_scatter(ratios: list[float]) -> float | None:
    """The median absolute deviation of the log ratios from their median (0.05: about 5%)."""
    logs = [math.log(r) for r in ratios if r and r > 0]
    if not logs:
        return None
    centre = statistics.median(logs)
    return statistics.median(abs(x - centre) for x in logs)


def pooled(records: list[dict], bar: float = 0.10) -> dict:
    """Recorded runs of this bench together: the medians of every start-up-free and every trial
    figure, how scattered each kind is, and how many tunes picked the mode and lie within
    ``bar`` of each pooled median."""
    modes = {r["mode"] for r in records}
    scripts = {(r["script"], tuple(r["args"])) for r in records}
    if len(modes) != 1 or len(scripts) != 1:
        named = sorted({f"{r['script']} {' '.join(r['args'])} {r['mode']}" for r in records})
        raise ValueError(f"--pool: the files measure different things: {'; '.join(named)}")
    truth = [x for r in records for x in r["startup_free"]]
    trials = [x for r in records for x in r["trial"]]
    tunes = [t for r in records for t in r["tunes"]]
    ratios = [t["ratio"] for t in tunes if t.get("ratio")]
    if not truth or not trials or not ratios:
        raise ValueError("--pool: the files hold no start-up-free, trial or tune figure to compare")
    mode = modes.pop()
    m_truth, m_trial = statistics.median(truth), statistics.median(trials)
    return {
        "mode": mode, "runs": len(records),
        "startup_free": {"n": len(truth), "median": m_truth, "scatter": log_scatter(truth)},
        "trial": {"n": len(trials), "median": m_trial, "scatter": log_scatter(trials)},
        "tune": {"n": len(tunes), "median": statistics.median(ratios), "scatter": log_scatter(ratios),
                 "picked_mode": sum(t.get("winner") == mode for t in tunes),
                 "within_startup_free": sum(abs(x / m_truth - 1) <= bar for x in ratios),
                 "within_trial": sum(abs(x / m_trial - 1) <= bar for x in ratios)},
        "bar": bar,
    }


def print_pool(paths: list[Path]) -> None:
    records = []
    for path in paths:
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--pool: cannot read {path}: {exc}") from None
    try:
        found = pooled(records)
    except (KeyError, TypeError) as exc:
        raise SystemExit(f"--pool: not a file this bench wrote ({exc})") from None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"{found['runs']} runs, {found['mode']} against fp32; scatter is the median absolute deviation of log ratios")
    print(f"{'measurement':<16}{'figures':>8}{'median':>8}{'scatter':>9}")
    for kind in KINDS:
        row = found[kind]
        print(f"{kind:<16}{row['n']:>8}{row['median']:>8.3f}{row['scatter']:>9.3f}")
    tune = found["tune"]
    print(f"tunes that picked {found['mode']}: {tune['picked_mode']} of {tune['n']}; within {found['bar']:.0%} of the"
          f" pooled start-up-free median: {tune['within_startup_free']}, of the pooled trial median: {tune['within_trial']}")


def machine() -> dict:
    """The CPU by name, its precision ISA flags (AMX-BF16 or not), cores, Python, load average."""
    from probes import profile_for

    profile = profile_for("cpu")
    return {"name": profile.name, "cpu_flags": list(profile.cpu_flags or ()), "cores": os.cpu_count(),
            "python": platform.python_version(), "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", nargs="?", choices=sorted(presets(0)))
    parser.add_argument("--mode", default="bf16-mixed")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="start-up-free repeats")
    parser.add_argument("--short", type=int, help="units of the short plain run (default: the preset's)")
    parser.add_argument("--long", type=int, help="units of the long plain run (default: the preset's)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--trial-pairs", type=int, default=0,
                        help="each trial's figure: its paired speed-up over this many rounds (trial --pairs)")
    parser.add_argument("--tunes", type=int, default=5)
    parser.add_argument("--tune-extra", default="", help="more tune options, e.g. --tune-extra='--speedup-within 0.1'")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--pool", type=Path, nargs="+", metavar="FILE",
                        help="compare recorded runs of this bench together instead of measuring")
    args = parser.parse_args()
    if args.pool:
        print_pool(args.pool)
        return
    if args.example is None:
        parser.error("name an example to measure, or --pool FILE... to read recorded runs")
    preset = presets(args.width)[args.example]
    if args.mode not in preset.mode_args:
        raise SystemExit(f"--mode {args.mode}: {args.example} applies only {', '.join(preset.mode_args)}")

    if min(args.repeats, args.trials) < 1 or args.tunes < 0 or args.trial_pairs < 0:
        raise SystemExit("--repeats and --trials must be at least 1, --tunes and --trial-pairs at least 0")
    short, long = args.short or preset.short, args.long or preset.long
    if long <= short:
        raise SystemExit(f"--long {long} must be above --short {short}: their difference is what is timed")
    extra = tuple(shlex.split(args.tune_extra))
    results: dict[str, list] = {kind: [] for kind in KINDS}
    started: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as home:
        for kind, r in schedule({"startup_free": args.repeats, "trial": args.trials, "tune": args.tunes}):
            started.append({"kind": kind, "index": r, "at_s": round(time.perf_counter() - t0, 1)})
            if kind == "startup_free":
                results[kind].append(startup_free_once(preset, args.mode, r, short, long, home))
            elif kind == "trial":
                results[kind].append(trial_ratio(preset, args.mode, args.trial_pairs))
            else:
                results[kind].append(tune_ratio(preset, args.mode, extra))
    truth, trials, tunes = results["startup_free"], results["trial"], results["tune"]
    true_ratio = statistics.median(truth)

    def off(ratio: float | None) -> str:
        return "-" if ratio is None else f"{ratio / true_ratio - 1:+.0%}"

    print(f"{' '.join([preset.script, *preset.args])}, {args.mode} against fp32 on {platform.processor() or platform.machine()}"
          f" ({os.cpu_count()} cores): fp32 step time over {args.mode}'s")
    print(f"{'measurement':<34}{'ratio':>8}{'vs start-up free':>18}  note")
    print(f"{'start-up free (median)':<34}{true_ratio:>8.3f}{'':>18}  {', '.join(f'{r:.3f}' for r in truth)}")
    trial_name = "mpadvise trial (median)" if not args.trial_pairs else f"trial --pairs {args.trial_pairs} (median)"
    print(f"{trial_name:<34}{statistics.median(trials):>8.3f}{off(statistics.median(trials)):>18}"
          f"  {', '.join(f'{r:.3f}' for r in trials)}")
    for i, t in enumerate(tunes, 1):
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        interval = "" if t["low"] is None else f" [{t['low']:.3f}, {t['high']:.3f}]"
        name = f"mpadvise tune #{i} (winner {t['winner']})"
        print(f"{name:<34}{ratio:>8}{off(t['ratio']):>18}  {t['basis']}{interval}, {t['disturbed']} disturbed")
    for label, found in (tunes[-1]["utilisation"] if tunes else {}).items():
        mfu = "-" if found["mfu"] is None else f"{found['mfu']:.1%} of {found['mfu_dtype']}'s probed peak"
        tflops = "-" if found["tflops"] is None else f"{found['tflops']:.3g}"
        print(f"last tune, {label}: {tflops} TFLOP/s, MFU {mfu}")
    record = {"script": preset.script, "args": list(preset.args), "mode": args.mode, "machine": machine(),
              "tune_extra": list(extra), "trial_pairs": args.trial_pairs,
              "order": "interleaved", "started": started, "startup_free": truth, "trial": trials, "tunes": tunes}
    if truth and trials and any(t["ratio"] for t in tunes):
        found = pooled([record])
        print("scatter (median absolute deviation of log ratios): "
              + ", ".join(f"{kind} {found[kind]['scatter']:.3f}" for kind in KINDS))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(args.json, json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
