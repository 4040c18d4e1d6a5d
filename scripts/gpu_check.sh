#!/usr/bin/env bash
# The checks that need a GPU, for a machine without network and a few minutes of GPU time:
# the GPU tests, the probe and its matmul benchmark, a trial of every mode the GPU supports on
# a small MLP (function), a trial of every mode and FP8 on a GPU-bound transformer LM (timings),
# and a short tune. Packages the machine lacks come from .whl/ (scripts/gpu_wheels.sh prepares
# it); mpadvise itself runs from this source tree.
#
#   bash scripts/gpu_check.sh                      every step, on the GPU machine; fails at once without a GPU
#   bash scripts/gpu_check.sh --only lm,tune       these steps (and the setup they need) only
#   bash scripts/gpu_check.sh --skip tests         every step but these
#   bash scripts/gpu_check.sh --dry-run            every step on a CPU: pytest collection instead of
#                                                  the GPU tests, small models (scripts/gpu_check_dryrun.sh)
#
# Steps, in the order they run (the most telling first, for a first call that cannot finish):
# requirements imports probe lm tests trial tune bench.
#   wheels        (setup) installs .whl/ into $MPADVISE_GPU_SITE; `--skip wheels` uses what is there
#   requirements  every requirement of the installed wheels is met here
#   imports       every module of probes, policies and advisor, and the libraries the modes load
#   probe         mpadvise probe --json: the modes the later steps try (it also runs, for them,
#                 when it is not selected)
#   lm            fp32, every supported mode and FP8 on examples/gpt_lm.py (GPU-bound): per mode
#                 the step time, the speed-up over fp32 and over bf16-mixed, and the achieved
#                 TFLOP/s as a fraction of the datasheet peak that probe --json reports
#   tests         pytest tests/gpu
#   trial         every supported mode on examples/mlp.py: each runs to a verdict
#   tune          a short tune of the LM, its time budget within the step; then the cache
#                 lookup (mpadvise show) finds the winner on this machine
#   bench         mpadvise probe --json --bench: matmul TFLOP/s per dtype (replaces probe.json)
#
# Writes these 8 files to $OUT (default ./gpu-check), nothing else:
#   summary.txt  the source commit, each step's exit code, seconds and result, the verdicts and
#                timings; rewritten as each step starts and ends, and on TERM, INT or HUP
#   env.txt      the machine, versions, the wheels' requirements met here, every module imported
#   log.txt      each step's command and stderr tail     tests.txt  pytest's output
#   probe.json   probe --json (--bench once the bench ran)
#   trial.json, lm.json  one JSON line per finished trial (MPADVISE_TRIAL_STREAM), then the
#                comparison: a step stopped part-way keeps every trial it finished
#   tune.json    mpadvise tune --json
# A step's own file is emptied when it starts; the other files are kept, so a second call with
# --only into the same $OUT completes the first one's (summary.txt, env.txt and log.txt are
# rewritten).
#
# Environment:
#   OUT                          the output folder (default ./gpu-check)
#   MPADVISE_SOURCE              the commit this tree is (the GPU machine's copy has no .git);
#                                default: git rev-parse HEAD where there is a .git, else "unknown"
#   MPADVISE_GPU_CHECK_BUDGET    seconds for all steps (default 420, times the scale); a step is
#                                not started when less than half its limit is left ("not reached")
#   MPADVISE_GPU_CHECK_SCALE     multiplies every step's limit and each trial's timeout (default 1;
#                                "auto" with --dry-run: from how long importing torch takes here)
#   MPADVISE_GPU_SITE            where the wheels go (default /tmp/site)
#   PYTHON                       the interpreter (default python3)
# Exits 0 when every step passed, 1 when one failed or was not reached, 2 on a usage error, and
# 128 + the signal's number when stopped by a signal.
set -euo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS=(requirements imports probe lm tests trial tune bench)
usage() {
    echo "usage: scripts/gpu_check.sh [--dry-run] [--only STEP,...] [--skip STEP,...]; steps: wheels ${ALL_STEPS[*]}" >&2
    exit 2
}
DRY_RUN=0 ONLY="" SKIP=""
while (($#)); do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --only | --skip)
            (($# > 1)) || usage
            if [ "$1" = --only ]; then ONLY+="${ONLY:+,}$2"; else SKIP+="${SKIP:+,}$2"; fi
            shift ;;
        --only=*) ONLY+="${ONLY:+,}${1#--only=}" ;;
        --skip=*) SKIP+="${SKIP:+,}${1#--skip=}" ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) usage ;;
    esac
    shift
done
# check_steps OPTION LIST: every name in LIST is a step, else one line and exit 2.
check_steps() {
    local name
    for name in ${2//,/ }; do
        if [[ " wheels ${ALL_STEPS[*]} " != *" $name "* ]]; then
            echo "gpu_check: unknown step '$name' in $1; the steps are: wheels ${ALL_STEPS[*]}" >&2
            exit 2
        fi
    done
}
check_steps --only "$ONLY"
check_steps --skip "$SKIP"
selected() {  # selected STEP: whether STEP runs in this call
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$1,"* ]]; then return 1; fi
    [[ ",$SKIP," != *",$1,"* ]]
}
wheels_wanted() {  # the wheels are setup: installed for any other step, unless skipped
    local step
    [[ ",$SKIP," != *",wheels,"* ]] || return 1
    [[ ",$ONLY," != *",wheels,"* ]] || return 0
    for step in "${ALL_STEPS[@]}"; do if selected "$step"; then return 0; fi; done
    return 1
}

OUT=${OUT:-gpu-check}
SITE=${MPADVISE_GPU_SITE:-/tmp/site}
PY=${PYTHON:-python3}
SCALE=${MPADVISE_GPU_CHECK_SCALE:-$( ((DRY_RUN)) && echo auto || echo 1)}
if [ "$SCALE" != auto ] && ! [[ "$SCALE" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_check: MPADVISE_GPU_CHECK_SCALE=$SCALE: expected a whole number from 1, or auto" >&2
    exit 2
fi
if [ -n "${MPADVISE_GPU_CHECK_BUDGET:-}" ] && ! [[ "$MPADVISE_GPU_CHECK_BUDGET" =~ ^[0-9]+$ ]]; then
    echo "gpu_check: MPADVISE_GPU_CHECK_BUDGET=$MPADVISE_GPU_CHECK_BUDGET: expected whole seconds" >&2
    exit 2
fi
SOURCE=${MPADVISE_SOURCE:-}
if [ -z "$SOURCE" ]; then
    SOURCE=$(git rev-parse HEAD 2> /dev/null || echo unknown)
    if [ "$SOURCE" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2> /dev/null)" ]; then
        SOURCE+=" with uncommitted changes"
    fi
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The tune's cache and study, the tuned config file and every scratch file go to $WORK, so
# nothing but the 8 files reaches $OUT.
export MPADVISE_HOME=$WORK/home PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
SUMMARY=$OUT/summary.txt LOG=$OUT/log.txt ENV=$OUT/env.txt
: > "$LOG"
: > "$ENV"
START=$(date +%s)
DEADLINE=0 BUDGET=0
ROWS=() FAILED=() NOT_REACHED=() RECORDED=""
CURRENT="" STEP_PID="" FINISH="" STOPPED=""

if ((DRY_RUN)); then
    DEVICE=cpu KIND=cpu TRIAL_TIMEOUT=120
    TUNE_PRIORS=(--no-priors)  # a CPU's matmul ratios rule out every candidate untried
    MLP=(--width 128 --samples 4096 --batch-size 64)
    LM=(--width 64 --layers 2 --heads 4 --context 32 --vocab 256 --batch-size 8 --lr 3e-3)
else
    DEVICE=cuda:0 KIND=cuda TRIAL_TIMEOUT=90
    TUNE_PRIORS=()
    MLP=(--width 1024 --batch-size 256)
    # 210 million matmul weights and 8192 tokens a step, 11 TFLOP: the matmuls dominate even in FP8.
    LM=(--width 2048 --layers 4 --heads 16 --context 1024 --vocab 4096 --batch-size 8)
fi
STEPS=(--steps 40 --warmup 5)  # 45 steps: the verdicts need at least 32 to judge a curve

# record NAME EXIT SECONDS STATUS TEXT: one row of the summary; STATUS is ok, FAIL, unverified,
# stopped or "not reached".
record() {
    RECORDED+=" $1 "
    ROWS+=("$(printf '%-13s %5s %6s  %-11s %s' "$1" "$2" "$3" "$4" "$5")")
    if [ "$4" = FAIL ] || [ "$4" = stopped ]; then FAILED+=("$1"); fi
    if [ "$4" = "not reached" ]; then NOT_REACHED+=("$1"); fi
}
verdict() { if (($1 == 0)); then echo ok; else echo FAIL; fi; }

write_summary() {
    {
        echo "mpadvise GPU check$( ((DRY_RUN)) && echo ' (dry run, CPU)'), $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -n)"
        echo "source $SOURCE; $(($(date +%s) - START)) s in all; steps: ${ONLY:-all}${SKIP:+, less $SKIP}; limits x$SCALE, budget ${BUDGET} s"
        printf '%-13s %5s %6s  %-11s %s\n' step exit secs status result
        printf '%s\n' "${ROWS[@]}"
        if [ -n "$STOPPED" ]; then
            echo "STOPPED by $STOPPED${FAILED[*]:+; FAIL: ${FAILED[*]}}"
        elif [ -n "$CURRENT" ]; then
            echo "RUNNING: $CURRENT, started $(($(date +%s) - STEP_START)) s before this summary was written${FAILED[*]:+; FAIL: ${FAILED[*]}}"
            echo "(a summary that ends here: the check was killed during $CURRENT; its file holds what it finished)"
        elif ((${#FAILED[@]})); then
            echo "FAIL: ${FAILED[*]}"
        elif ((${#NOT_REACHED[@]} == 0)); then
            echo "PASS"
        fi
        if ((${#NOT_REACHED[@]})); then
            local rest=${NOT_REACHED[*]}
            echo "not reached: $rest; finish with: scripts/gpu_check.sh$( ((DRY_RUN)) && echo ' --dry-run') --only ${rest// /,}"
        fi
    } > "$WORK/summary.txt"
    mv "$WORK/summary.txt" "$SUMMARY"  # whole, or not at all; and nothing else in $OUT
}

# begin NAME FINISH: NAME starts; FINISH is the function that records it from what its files
# hold, which a signal calls too.
begin() {
    CURRENT=$1 FINISH=$2 STEP_START=$(date +%s)
    write_summary
}
end() {
    CURRENT="" FINISH=""
    write_summary
}

# run_step NAME LIMIT STDOUT COMMAND...: run under its own timeout, within what is left of the
# budget; sets RC (124 or 137: timed out) and SECS, and appends the stderr tail to log.txt.
# The command runs in the background so that a signal reaches the trap at once.
run_step() {
    local name=$1 limit=$2 stdout=$3 left t0
    shift 3
    left=$((DEADLINE - $(date +%s)))
    if ((limit > left)); then limit=$left; fi
    : > "$WORK/$name.err"
    printf '=== %s (limit %s s): %s\n' "$name" "$limit" "$*" >> "$LOG"
    t0=$(date +%s)
    # SIGINT first, so that the CLI kills its trial's process group; SIGKILL 20 s later.
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$stdout" 2> "$WORK/$name.err" &
    STEP_PID=$!
    set +e
    wait "$STEP_PID"
    RC=$?
    set -e
    STEP_PID=""
    SECS=$(($(date +%s) - t0))
    step_log "$name"
}
step_log() {
    tail -c 12000 "$WORK/$1.err" >> "$LOG"
    if ((RC == 124 || RC == 137)); then echo "--- $1: timed out after $SECS s" >> "$LOG"; fi
}

# reachable NAME LIMIT: whether NAME may start (at least half its limit is left of the budget);
# records it "not reached" otherwise.
reachable() {
    local left=$((DEADLINE - $(date +%s)))
    if ((left * 2 >= $2)); then return 0; fi
    record "$1" - 0 "not reached" "$left s were left of the $BUDGET s budget; the step's limit is $2 s"
    return 1
}

timed_out() {  # the reason a step has no result, if it ran out of time or was stopped
    if [ -n "$STOPPED" ]; then echo "stopped by $STOPPED after ${SECS} s; "
    elif ((RC == 124 || RC == 137)) && ((SECS > 0)); then echo "timed out after ${SECS} s; "; fi
}

on_signal() {  # on_signal NAME CODE: stop the running step, record what it finished, exit
    trap '' INT TERM HUP
    STOPPED=$1
    if [ -n "$STEP_PID" ]; then
        kill -INT "$STEP_PID" 2> /dev/null || true  # timeout passes it on; SIGKILL follows in 20 s
        wait "$STEP_PID" 2> /dev/null || true
        STEP_PID=""
        RC=$2 SECS=$(($(date +%s) - STEP_START))
        step_log "$CURRENT"
    fi
    if [ -n "$FINISH" ]; then
        RC=$2 SECS=$(($(date +%s) - STEP_START))
        "$FINISH"
    fi
    CURRENT=""
    local step
    for step in "${ALL_STEPS[@]}"; do
        if selected "$step" && [[ "$RECORDED" != *" $step "* ]]; then
            record "$step" - 0 "not reached" "the check was stopped before it"
        fi
    done
    write_summary
    cat "$SUMMARY" >&2
    exit "$2"
}
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGHUP 129' HUP

# The checks' own Python: requirement and import checks, the mode list, verdicts and timings.
cat > "$WORK/check.py" <<'PY'
"""Helpers of scripts/gpu_check.sh: python check.py COMMAND ARGS."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import pkgutil
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

RUN_OK = ("ok", "unstable")  # the trial ran and was judged; "unstable" is a verdict, not a fault


def requirements(site: str) -> int:
    """Every requirement of the installed wheels, met by what this interpreter imports."""
    missing, conflicts, names = [], [], []
    for dist in sorted(md.distributions(path=[site]), key=lambda d: d.metadata["Name"].lower()):
        names.append(f"{dist.metadata['Name']}=={dist.version}")
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                missing.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                conflicts.append(f"{dist.metadata['Name']} needs {req}, this machine has {have}")
    print(f"wheels in {site}: {' '.join(names)}")
    for name in ("torch", "numpy", "typer", "click", "rich", "typing_extensions", "pytest",
                 "pytest-timeout", "nvidia-ml-py", "uvloop", "anyio", "packaging"):
        try:
            print(f"  machine: {name}=={md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  machine: {name} not installed")
    for line in missing:
        print(f"MISSING: {line}")
    for line in conflicts:
        print(f"version warning: {line}")
    print(f"{len(names)} wheels; {len(missing)} requirements missing, {len(conflicts)} version warnings")
    return 1 if missing or not names else 0


def imports() -> int:
    """Import every module of the three packages, and the libraries the modes load lazily."""
    failed: list[str] = []
    count = 0

    def onerror(name: str) -> None:
        failed.append(f"{name}: {sys.exc_info()[1]!r}")

    for package in ("probes", "policies", "advisor"):
        module = importlib.import_module(package)
        count += 1
        for info in pkgutil.walk_packages(module.__path__, package + ".", onerror=onerror):
            if info.name.rsplit(".", 1)[-1] == "__main__":
                continue  # running it is the CLI, not an import
            try:
                importlib.import_module(info.name)
                count += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the result
                failed.append(f"{info.name}: {exc!r}")
    for name in ("torchao.float8", "optuna", "sqlite_utils", "fastapi", "uvicorn", "pynvml"):
        try:
            module = importlib.import_module(name)
            where = getattr(module, "__file__", "") or ""
            print(f"  {name} from {where}")
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{name}: {exc!r}")
    for line in failed:
        print(f"IMPORT FAILED: {line}")
    print(f"{count} modules of probes, policies and advisor imported; {len(failed)} failed")
    return 1 if failed else 0


def _device(probe_json: str, kind: str) -> dict:
    data = json.loads(Path(probe_json).read_text())
    return next(d for d in data["devices"] if d["profile"]["kind"] == kind)


def modes(probe_json: str, kind: str) -> int:
    """Print four lines: the modes to trial (FP8 and fp32 aside; on a GPU those it runs natively,
    on a CPU every mode it runs, to prove their paths), the modes to tune (the safe default, and
    tf32 where supported: few enough that close finalists cannot use up the time), then
    fp8-torchao's and fp8-te's plan: "run", "unverified: why" or "fail: why" (a GPU with FP8
    whose torchao, carried in the wheels, does not load)."""
    device = _device(probe_json, kind)
    support = device["modes"]
    runs = {m: s["supported"] and (kind == "cpu" or not s["emulated"]) for m, s in support.items()}
    trial = [m for m in support if runs[m] and not m.startswith("fp8") and m != "fp32"]
    print(" ".join(trial))
    # On a CPU without bf16 hardware the safe default is fp32: tune bf16-mixed there, the GPU's
    # usual default, so that the dry run's tune runs trials too.
    default = device["safe_default"]["mode"]
    if kind == "cpu" and default == "fp32" and "bf16-mixed" in trial:
        default = "bf16-mixed"
    tune = [default] + [m for m in ("tf32",) if m in trial]
    print(" ".join(dict.fromkeys(m for m in tune if m != "fp32")))
    capability = tuple(device["profile"].get("compute_capability") or ())
    for mode in ("fp8-torchao", "fp8-te"):
        s = support.get(mode)
        if s is None:
            print(f"unverified: this version has no {mode} mode")
        elif runs[mode]:
            print("run")
        elif mode == "fp8-torchao" and kind == "cuda" and capability >= (8, 9):
            print(f"fail: {s['reason']}")
        else:
            print(f"unverified: {s['reason']}")
    return 0


def _stream(path: str) -> tuple[dict | None, list[dict], bool]:
    """The reference, the candidates and whether the comparison was reached, from a trial's
    stream (one JSON line per finished trial, then the comparison)."""
    trials, comparison = [], None
    text = Path(path).read_text() if Path(path).exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short when the step was killed
        if record.get("event") == "comparison":
            comparison = record
        elif record.get("event") == "trial":
            trials.append(record)
    if comparison is not None:
        return comparison["reference"], comparison["candidates"], True
    reference = next((t for t in trials if t["role"] == "reference"), None)
    return reference, [t for t in trials if t["role"] == "candidate"], False


def judge(stream: str, *expected: str) -> int:
    """One line per trial of a trial's stream; non-zero when a mode did not run to a verdict."""
    reference, candidates, complete = _stream(stream)
    if reference is None:
        print("    fp32                   no result: the reference did not finish")
        return 1
    bad = 0 if reference["outcome"] in RUN_OK + ("too-short",) and reference.get("exit_code") == 0 else 1
    for label, c in [("fp32", reference)] + [(c["label"], c) for c in candidates]:
        speed = f"{c['speedup_vs_fp32']:.2f}x fp32" if c.get("speedup_vs_fp32") else "-"
        memory = f"{(c.get('peak_memory') or 0) / 2**20:.0f} MiB {c.get('memory_kind') or ''}"
        note = c.get("reason") or "; ".join(c.get("notes") or [])
        print(f"    {label:<22} {c['outcome']:<10} {speed:<12} {memory:<24} {note[:150]}")
        if label != "fp32" and c["outcome"] not in RUN_OK:
            bad += 1
    seen = {c["mode"] for c in candidates}
    for mode in expected:
        if mode not in seen:
            print(f"    {mode:<22} did not finish")
            bad += 1
    if not complete:
        print("    (stopped before the comparison: these verdicts lack the fp32 replicate's allowance)")
    return 1 if bad else 0


def lm(stream: str, probe_json: str, kind: str, *lm_args: str) -> int:
    """Per mode of the LM's trial: step time, speed-up over fp32 and over bf16-mixed, achieved
    TFLOP/s and its fraction of the datasheet peak of the mode's dtype."""
    parser = argparse.ArgumentParser()
    for name in ("--width", "--layers", "--context", "--vocab", "--batch-size"):
        parser.add_argument(name, type=int, required=True)
    sizes, _ = parser.parse_known_args(lm_args)
    sys.path.insert(0, "examples")
    from gpt_lm import matmul_weights, train_flops

    from policies import mode_class

    peaks = _device(probe_json, kind).get("peak_tflops") or {}
    reference, candidates, _ = _stream(stream)
    timed = [c for c in ([reference] if reference else []) + candidates
             if c["outcome"] in RUN_OK + ("too-short",) and (c.get("step_time") or {}).get("median")]
    if not timed:
        print("    no step times: no trial of the LM finished")
        return 1
    shape = dict(width=sizes.width, layers=sizes.layers, context=sizes.context, vocab=sizes.vocab)
    weights = matmul_weights(width=sizes.width, layers=sizes.layers, vocab=sizes.vocab)
    print(f"    {_si(train_flops(**shape, batch=sizes.batch_size))}FLOP a step: {weights:,} matmul weights, "
          f"{sizes.batch_size} x {sizes.context} tokens, {sizes.layers} layers of width {sizes.width}")
    median = {c["mode"]: c["step_time"]["median"] for c in timed}
    for c in timed:
        seconds = c["step_time"]["median"]
        flops = train_flops(**shape, batch=c.get("global_batch") or sizes.batch_size)
        tflops = flops / seconds / 1e12
        family = mode_class(c["mode"]).dtype_family
        peak = peaks.get(family)
        fraction = f"{tflops / peak:6.1%} of the {family} peak, {peak:g}" if peak else f"no datasheet {family} peak here"
        over = {mode: f"{median[mode] / seconds:5.2f}x" if mode in median else "    -" for mode in ("fp32", "bf16-mixed")}
        print(f"    {c['mode']:<14} {seconds * 1e3:9.2f} ms {over['fp32']} fp32 {over['bf16-mixed']} bf16-mixed "
              f"{_si(tflops * 1e12):>9}FLOP/s  {fraction}")
    return 0


def _si(value: float) -> str:
    """``value`` with an SI prefix and a trailing space: 1.44e12 -> '1.44 T'."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def tune(tune_json: str) -> int:
    data = json.loads(Path(tune_json).read_text())
    speed = data.get("speedup_vs_fp32") or 0.0
    print(f"winner {data.get('winner_label')} ({speed:.2f}x fp32), {data.get('trials_run')} trials, "
          f"{data.get('wall_s', 0):.0f} s; {data.get('stop_reason', '')[:100]}")
    return 0 if data.get("winner") else 1


def cached(show_json: str) -> int:
    """Whether mpadvise show finds a valid recommendation for this machine (the tune's)."""
    data = json.loads(Path(show_json).read_text())
    here = [r for r in data.get("recommendations", []) if r.get("this_machine")]
    valid = [r for r in here if r.get("valid")]
    if valid:
        print(f"cache lookup: {valid[0]['mode']} for {valid[0].get('script_name')}, valid here")
        return 0
    status = "; ".join(r.get("status", "") for r in here) or "no entry for this machine"
    print(f"cache lookup found no valid entry: {status}")
    return 1


def bench(probe_json: str, kind: str) -> int:
    rows = _device(probe_json, kind).get("bench") or []
    for row in rows:
        if row.get("tflops") is None:
            print(f"    {row['dtype']:<6} skipped: {row.get('skipped')}")
            continue
        peak = f", {row['fraction_of_peak']:.0%} of peak {row['peak_tflops']:g}" if row.get("fraction_of_peak") else ""
        print(f"    {row['dtype']:<6} {_si(row['tflops'] * 1e12):>9}FLOP/s at {row['size']}{peak}")
    return 0 if any(row.get("tflops") for row in rows) else 1


sys.exit(globals()[sys.argv[1]](*sys.argv[2:]))
PY
check() { "$PY" "$WORK/check.py" "$@"; }

# --- the GPU, or a loud stop -------------------------------------------------------------
no_gpu() {
    echo "gpu_check: FAIL: no usable GPU here: $1. This check needs a CUDA GPU; on a CPU," \
        "run scripts/gpu_check_dryrun.sh (or scripts/gpu_check.sh --dry-run)." >&2
    record gpu 1 0 FAIL "no usable GPU: $1"
    write_summary
    cat "$SUMMARY" >&2
    exit 1
}
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -n)  $(uname -srm)  source: $SOURCE"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
} >> "$ENV"
if ((DRY_RUN)); then
    # How slow this machine is now: importing torch takes a few seconds on an idle one, minutes
    # on a loaded one; "auto" scales every limit by it.
    t0=$(date +%s)
    "$PY" -c 'import torch' 2>> "$LOG" || true
    import_s=$(($(date +%s) - t0))
    if [ "$SCALE" = auto ]; then SCALE=$((import_s / 8 > 3 ? (import_s + 7) / 8 : 3)); fi
    record cpu - "$import_s" ok "dry run on a CPU, the CUDA-only parts left out; importing torch took $import_s s: limits x$SCALE"
else
    if [ "$SCALE" = auto ]; then SCALE=1; fi
    command -v nvidia-smi > /dev/null || no_gpu "nvidia-smi is not on PATH"
    timeout 60 nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1 || no_gpu "nvidia-smi failed: $(tail -n 1 "$WORK/nvidia-smi.txt")"
    cat "$WORK/nvidia-smi.txt" >> "$ENV"
    probe_limit=${MPADVISE_GPU_PROBE_TIMEOUT:-120}
    probe_rc=0
    gpu=$(timeout "$probe_limit" "$PY" -c '
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")
' 2> "$WORK/gpu.err") || probe_rc=$?
    if ((probe_rc == 124 || probe_rc == 137)); then
        cat "$WORK/gpu.err" >> "$LOG"
        no_gpu "the torch probe (import torch, CUDA initialisation) timed out after $probe_limit s"
    elif ((probe_rc != 0)); then
        cat "$WORK/gpu.err" >> "$LOG"
        why=$(tail -n 1 "$WORK/gpu.err" | cut -c1-200)
        no_gpu "torch sees no CUDA device (${why:-the probe exited $probe_rc with no message})"
    fi
    echo "gpu: $gpu" >> "$ENV"
    record gpu 0 "$(($(date +%s) - START))" ok "$gpu"
fi
BUDGET=${MPADVISE_GPU_CHECK_BUDGET:-$((420 * SCALE))}
DEADLINE=$((START + BUDGET))
TRIAL_TIMEOUT=$((TRIAL_TIMEOUT * SCALE))
limit() { echo $(($1 * SCALE)); }  # a step's limit: its seconds on the GPU machine, scaled
write_summary

# --- the wheels the machine lacks ----------------------------------------------------------
finish_wheels() {
    cat "$WORK/wheels.txt" >> "$ENV" 2> /dev/null || true
    if ((RC == 0)); then
        wheels=(.whl/*.whl)
        record wheels 0 "$SECS" ok "${#wheels[@]} wheels from .whl/ into $SITE (the set checked against scripts/gpu_wheels.txt)"
    else
        record wheels "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/wheels.err")"
    fi
}
if wheels_wanted; then
    if ! compgen -G ".whl/*.whl" > /dev/null; then
        record wheels 1 0 FAIL "no wheels in .whl/: run scripts/gpu_wheels.sh where there is network, and carry .whl"
    elif reachable wheels "$(limit 180)"; then
        begin wheels finish_wheels
        # shellcheck disable=SC2016 # $1 and $2 are the inner shell's arguments
        run_step wheels "$(limit 180)" "$WORK/wheels.txt" bash -c '
            PYTHON="$1" bash scripts/gpu_wheels.sh --check &&
            "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" .whl/*.whl' \
            _ "$PY" "$SITE"
        finish_wheels
        end
    fi
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

# --- requirements and imports ----------------------------------------------------------------
finish_requirements() {
    cat "$WORK/requirements.txt" >> "$ENV"
    record requirements "$RC" "$SECS" "$(verdict "$RC")" "$(timed_out)$(tail -n 1 "$WORK/requirements.txt")"
}
if selected requirements && reachable requirements "$(limit 60)"; then
    begin requirements finish_requirements
    run_step requirements "$(limit 60)" "$WORK/requirements.txt" "$PY" "$WORK/check.py" requirements "$SITE"
    finish_requirements
    end
fi
finish_imports() {
    cat "$WORK/imports.txt" >> "$ENV"
    record imports "$RC" "$SECS" "$(verdict "$RC")" "$(timed_out)$(tail -n 1 "$WORK/imports.txt")"
}
if selected imports && reachable imports "$(limit 120)"; then
    begin imports finish_imports
    run_step imports "$(limit 120)" "$WORK/imports.txt" "$PY" "$WORK/check.py" imports
    finish_imports
    end
fi

# --- probe: the modes to try come from it (no benchmark: that is its own step) --------------
TRIAL_MODES=() TUNE_MODES=() FP8_TORCHAO="unverified: the probe did not run" FP8_TE="$FP8_TORCHAO"
PROBED=0
finish_probe() {
    if ((RC == 0)) && check modes "$OUT/probe.json" "$KIND" > "$WORK/modes.txt" 2>> "$LOG"; then
        read -r -a TRIAL_MODES < <(sed -n 1p "$WORK/modes.txt") || true
        read -r -a TUNE_MODES < <(sed -n 2p "$WORK/modes.txt") || true
        FP8_TORCHAO=$(sed -n 3p "$WORK/modes.txt")
        FP8_TE=$(sed -n 4p "$WORK/modes.txt")
        PROBED=1
        local why="" step
        if ! selected probe; then
            for step in trial lm tune; do if selected "$step"; then why+="${why:+ }$step"; fi; done
            why=" (run for the modes of: $why)"
        fi
        record probe 0 "$SECS" ok "modes: fp32 ${TRIAL_MODES[*]}; tune: ${TUNE_MODES[*]}; fp8-torchao: $FP8_TORCHAO$why"
    else
        FP8_TORCHAO="unverified: the probe failed" FP8_TE="unverified: the probe failed"
        record probe "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/probe.err" 2> /dev/null)"
    fi
}
if { selected probe || selected trial || selected lm || selected tune; } && reachable probe "$(limit 90)"; then
    begin probe finish_probe
    run_step probe "$(limit 90)" "$OUT/probe.json" "$PY" -m advisor.cli probe --json
    finish_probe
    end
fi

# --- trials: `mpadvise trial`, each finished trial streamed to the step's file ----------------
# trial_step NAME LIMIT SCRIPT ARGS_VAR MODE...: a trial of the MODEs on SCRIPT with the
# arguments held in the array named ARGS_VAR, streamed to $OUT/NAME.json.
trial_step() {
    local name=$1 step_limit=$2 script=$3
    local -n script_args=$4
    shift 4
    local args=() mode
    for mode in "$@"; do args+=(-m "$mode"); done
    : > "$OUT/$name.json"
    MPADVISE_TRIAL_STREAM=$OUT/$name.json run_step "$name" "$step_limit" "$WORK/$name.stdout" \
        "$PY" -m advisor.cli trial "$script" "${args[@]}" "${STEPS[@]}" --timeout "$TRIAL_TIMEOUT" \
        --device "$DEVICE" --json -- "${script_args[@]}"
}
# judge_step NAME WHAT MODE...: record NAME ok when every mode ran to a verdict (exit 3 says a
# candidate was judged unstable: a verdict, which the rows show), then a row per trial.
judge_step() {
    local name=$1 what=$2 judged=0
    shift 2
    check judge "$OUT/$name.json" "$@" > "$WORK/judge.txt" 2>> "$LOG" || judged=$?
    if [ -z "$STOPPED" ] && ((RC == 0 || RC == 3)) && ((judged == 0)); then
        record "$name" "$RC" "$SECS" ok "$what ran to a verdict"
    else
        record "$name" "$RC" "$SECS" FAIL "$(timed_out)$what did not all run to a verdict: $(tail -n 1 "$WORK/$name.err" | cut -c1-300)"
    fi
    while IFS= read -r line; do ROWS+=("$line"); done < "$WORK/judge.txt"
}

LM_MODES=()
finish_lm() {
    judge_step lm "fp32 and ${#LM_MODES[@]} modes on examples/gpt_lm.py ${LM[*]}" "${LM_MODES[@]}"
    if check lm "$OUT/lm.json" "$OUT/probe.json" "$KIND" "${LM[@]}" > "$WORK/lm-report.txt" 2>> "$LOG"; then
        ROWS+=("  timings (median step; speed-up over fp32 and over bf16-mixed; achieved TFLOP/s):")
    fi
    while IFS= read -r line; do ROWS+=("$line"); done < "$WORK/lm-report.txt"
    # torchao travels with the wheels, so on a GPU with FP8 it must run.
    case "$FP8_TORCHAO" in
        run) ;;
        fail:*) record fp8-torchao - 0 FAIL "did not run: ${FP8_TORCHAO#fail: }" ;;
        *) record fp8-torchao - 0 unverified "${FP8_TORCHAO#unverified: }" ;;
    esac
    if [ "$FP8_TE" != run ]; then
        record fp8-te - 0 unverified "Transformer Engine is not installed here and builds from source (nvcc, longer than this check may take): ${FP8_TE#unverified: }"
    fi
}
if selected lm; then
    if ((!PROBED)); then
        record lm - 0 FAIL "no modes to trial: the probe did not run or failed"
    elif reachable lm "$(limit 240)"; then
        LM_MODES=("${TRIAL_MODES[@]}")
        if [ "$FP8_TORCHAO" = run ]; then LM_MODES+=(fp8-torchao); fi
        if [ "$FP8_TE" = run ]; then LM_MODES+=(fp8-te); fi
        begin lm finish_lm
        trial_step lm "$(limit 240)" examples/gpt_lm.py LM "${LM_MODES[@]}"
        finish_lm
        end
    fi
fi

# --- the GPU tests ----------------------------------------------------------------------------
finish_tests() { record tests "$RC" "$SECS" "$(verdict "$RC")" "$(timed_out)pytest: $(tail -n 1 "$OUT/tests.txt")"; }
if selected tests && reachable tests "$(limit 240)"; then
    begin tests finish_tests
    if ((DRY_RUN)); then
        run_step tests "$(limit 240)" "$OUT/tests.txt" "$PY" -m pytest -q -p no:cacheprovider --timeout 150 --collect-only tests/gpu
    else
        run_step tests "$(limit 240)" "$OUT/tests.txt" "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 150 tests/gpu
    fi
    finish_tests
    end
fi

finish_trial() { judge_step trial "fp32 and ${#TRIAL_MODES[@]} modes on examples/mlp.py ${MLP[*]}" "${TRIAL_MODES[@]}"; }
if selected trial; then
    if ((!PROBED)); then
        record trial - 0 FAIL "no modes to trial: the probe did not run or failed"
    elif reachable trial "$(limit 180)"; then
        begin trial finish_trial
        trial_step trial "$(limit 180)" examples/mlp.py MLP "${TRIAL_MODES[@]}"
        finish_trial
        end
    fi
fi

# --- a short tune of the LM, bounded by its step; then the cache lookup ----------------------
finish_tune() {
    if [ -z "$STOPPED" ] && ((RC == 0)) && check tune "$OUT/tune.json" > "$WORK/tune-line.txt" 2>> "$LOG"; then
        if timeout "$(limit 60)" "$PY" -m advisor.cli show --json > "$WORK/show.json" 2>> "$LOG" &&
            check cached "$WORK/show.json" >> "$WORK/tune-line.txt" 2>> "$LOG"; then
            record tune 0 "$SECS" ok "$(sed ':a;N;s/\n/; /;ba' "$WORK/tune-line.txt")"
        else
            record tune 0 "$SECS" FAIL "$(sed ':a;N;s/\n/; /;ba' "$WORK/tune-line.txt")"
        fi
    else
        record tune "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/tune.err" | cut -c1-300)"
    fi
    if [ -f "$WORK/gpt_lm.mpadvise.toml" ]; then
        { echo "=== the tuned config"; cat "$WORK/gpt_lm.mpadvise.toml"; } >> "$LOG"
    fi
}
if selected tune; then
    if ((!PROBED)); then
        record tune - 0 FAIL "no modes to tune: the probe did not run or failed"
    elif reachable tune "$(limit 240)"; then
        tune_limit=$(limit 240)
        left=$((DEADLINE - $(date +%s)))
        if ((tune_limit > left)); then tune_limit=$left; fi
        # The time budget bounds the search and the re-measurement (no trial or round starts
        # after it); the fp32 reference and its replicate run before it, and the last trial or
        # round may run past it: the rest of the step is left for those.
        time_budget=$((tune_limit * 2 / 5))
        tune_args=()
        for mode in "${TUNE_MODES[@]}"; do tune_args+=(-m "$mode"); done
        begin tune finish_tune
        : > "$OUT/tune.json"
        run_step tune "$tune_limit" "$OUT/tune.json" "$PY" -m advisor.cli tune examples/gpt_lm.py "${tune_args[@]}" \
            --trials 4 "${STEPS[@]}" --timeout "$TRIAL_TIMEOUT" --time-budget "$time_budget" --device "$DEVICE" "${TUNE_PRIORS[@]}" \
            --out "$WORK/gpt_lm.mpadvise.toml" --json -- "${LM[@]}"
        finish_tune
        end
    fi
fi

# --- the matmul benchmark -------------------------------------------------------------------
finish_bench() {
    if ((RC == 0)) && [ -z "$STOPPED" ] && check bench "$WORK/bench.json" "$KIND" > "$WORK/bench-rows.txt" 2>> "$LOG"; then
        cp "$WORK/bench.json" "$OUT/probe.json"
        record bench 0 "$SECS" ok "matmul TFLOP/s per dtype (probe.json now holds them):"
        while IFS= read -r line; do ROWS+=("$line"); done < "$WORK/bench-rows.txt"
    else
        record bench "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/bench.err" | cut -c1-300)"
    fi
}
if selected bench && reachable bench "$(limit 120)"; then
    begin bench finish_bench
    run_step bench "$(limit 120)" "$WORK/bench.json" "$PY" -m advisor.cli probe --json --bench
    finish_bench
    end
fi

cap() {  # keep the end of a file that grew past $2 bytes
    if [ -f "$1" ] && (($(stat -c %s "$1") > $2)); then
        tail -c "$2" "$1" > "$WORK/cap" && mv "$WORK/cap" "$1"
    fi
}
cap "$LOG" 4000000
cap "$ENV" 1000000
cap "$OUT/tests.txt" 2000000
write_summary
cat "$SUMMARY"
((${#FAILED[@]} == 0 && ${#NOT_REACHED[@]} == 0))
