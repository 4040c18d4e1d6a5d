#!/usr/bin/env bash
# The checks that need a GPU, as one run of under 8 minutes on a machine without network:
# the GPU tests, the probe with its matmul benchmark, a trial of every mode the GPU supports,
# torchao's FP8 on a wide MLP, and a short tune. Packages the machine lacks come from .whl/
# (scripts/gpu_wheels.sh prepares it); mpadvise itself runs from this source tree.
#
#   bash scripts/gpu_check.sh             on the GPU machine; fails at once where there is no GPU
#   bash scripts/gpu_check.sh --dry-run   every step on a CPU: collection instead of the GPU
#                                         tests, no benchmark, small models (scripts/gpu_check_dryrun.sh)
#
# Writes at most 8 small files to $OUT (or ./gpu-check):
#   summary.txt  each step's exit code, seconds and result, the modes' verdicts, PASS or FAIL
#   env.txt      the machine, versions, the wheels' requirements met here, every module imported
#   tests.txt    pytest tests/gpu          probe.json  mpadvise probe --json --bench
#   trial.json   every supported mode      fp8.json    fp8-torchao on examples/mlp.py --width 4096
#   tune.json    a short tune              log.txt     each step's command and stderr tail
# Exits 0 when every step passed, 1 when one failed. Each step runs under its own timeout
# and all of them within MPADVISE_GPU_CHECK_BUDGET seconds (default 420).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-gpu-check}
SITE=${MPADVISE_GPU_SITE:-/tmp/site}
BUDGET=${MPADVISE_GPU_CHECK_BUDGET:-420}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export MPADVISE_HOME=$WORK/home PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
SUMMARY=$OUT/summary.txt LOG=$OUT/log.txt ENV=$OUT/env.txt
: > "$LOG"
: > "$ENV"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
ROWS=()
FAILED=()

if ((DRY_RUN)); then
    DEVICE=cpu KIND=cpu TRIAL_TIMEOUT=120
    MLP=(--width 128 --samples 4096 --batch-size 64)
    FP8_MLP=(--width 256 --samples 4096 --batch-size 64)
    TUNE_MLP=("${MLP[@]}")
else
    DEVICE=cuda:0 KIND=cuda TRIAL_TIMEOUT=90
    MLP=(--width 1024 --batch-size 256)
    FP8_MLP=(--width 4096 --batch-size 256)  # FP8 pays off only on wide layers (multiples of 16)
    TUNE_MLP=("${FP8_MLP[@]}")  # wide enough that the modes' speeds differ by more than the noise
fi
STEPS=(--steps 40 --warmup 5)  # 45 steps: the verdicts need at least 32 to judge a curve

# record NAME EXIT SECONDS STATUS TEXT: one row of the summary; STATUS is ok, FAIL or unverified.
record() {
    ROWS+=("$(printf '%-13s %5s %6s  %-10s %s' "$1" "$2" "$3" "$4" "$5")")
    if [ "$4" = FAIL ]; then FAILED+=("$1"); fi
}

write_summary() {
    {
        echo "mpadvise GPU check$( ((DRY_RUN)) && echo ' (dry run, CPU)'), $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -n)"
        echo "source $(git rev-parse --short HEAD 2>/dev/null || echo '(no git here)'); $(($(date +%s) - START)) s in all"
        printf '%-13s %5s %6s  %-10s %s\n' step exit secs status result
        printf '%s\n' "${ROWS[@]}"
        if ((${#FAILED[@]})); then echo "FAIL: ${FAILED[*]}"; else echo "PASS"; fi
    } > "$SUMMARY"
    cat "$SUMMARY"
}

# run_step NAME LIMIT STDOUT COMMAND...: run under its own timeout, within what is left of the
# budget; sets RC (124 or 137: timed out) and SECS, and appends the stderr tail to log.txt.
run_step() {
    local name=$1 limit=$2 stdout=$3 left
    shift 3
    left=$((DEADLINE - $(date +%s)))
    : > "$WORK/$name.err"
    if ((left < 20)); then
        RC=124 SECS=0
        echo "not started: ${left} s were left of the ${BUDGET} s budget" | tee -a "$LOG" > "$WORK/$name.err"
        : > "$stdout"
        return 0
    fi
    if ((limit > left)); then limit=$left; fi
    printf '=== %s (limit %s s): %s\n' "$name" "$limit" "$*" >> "$LOG"
    local t0
    t0=$(date +%s)
    # SIGINT first, so that the CLI kills its trial's process group; SIGKILL 20 s later.
    set +e
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$stdout" 2> "$WORK/$name.err"
    RC=$?
    set -e
    SECS=$(($(date +%s) - t0))
    tail -c 12000 "$WORK/$name.err" >> "$LOG"
    if ((RC == 124 || RC == 137)); then echo "--- $name: timed out after $limit s" >> "$LOG"; fi
    cap "$stdout" 2000000
    return 0
}

cap() {  # keep the end of a file that grew past $2 bytes
    if [ -f "$1" ] && (($(stat -c %s "$1") > $2)); then
        tail -c "$2" "$1" > "$WORK/cap" && mv "$WORK/cap" "$1"
    fi
}

timed_out() {  # the reason a step has no result, if it ran out of time
    if ((RC == 124 || RC == 137)) && ((SECS > 0)); then echo "timed out after ${SECS} s; "; fi
}

# The checks' own Python: requirement and import checks, the mode list, the verdicts.
cat > "$WORK/check.py" <<'PY'
"""Helpers of scripts/gpu_check.sh: python check.py COMMAND ARGS."""
from __future__ import annotations

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


def modes(probe_json: str, kind: str) -> int:
    """Print four lines: the modes to trial (FP8 aside), the modes to tune (the safe default,
    and tf32 where supported: few enough that close finalists cannot use up the time), then
    fp8-torchao's and fp8-te's plan."""
    data = json.loads(Path(probe_json).read_text())
    device = next(d for d in data["devices"] if d["profile"]["kind"] == kind)
    support = device["modes"]
    trial = [m for m, s in support.items()
             if s["supported"] and not s["emulated"] and not m.startswith("fp8") and m != "fp32"]
    print(" ".join(trial))
    tune = [device["safe_default"]["mode"]] + [m for m in ("tf32",) if m in trial]
    print(" ".join(dict.fromkeys(m for m in tune if m != "fp32")))
    for mode in ("fp8-torchao", "fp8-te"):
        s = support.get(mode)
        if s is None:
            print(f"unverified: this version has no {mode} mode")
        elif s["supported"] and (kind == "cpu" or not s["emulated"]):
            print("run")
        else:
            print(f"unverified: {s['reason']}")
    return 0


def judge(trial_json: str, *expected: str) -> int:
    """One line per mode from a trial's JSON; non-zero when a mode did not run to a verdict."""
    data = json.loads(Path(trial_json).read_text())
    ref = data["reference"]
    rows = [("fp32", ref)] + [(c["label"], c) for c in data["candidates"]]
    bad = 0 if ref["outcome"] in RUN_OK + ("too-short",) and ref.get("exit_code") == 0 else 1
    seen = {c["mode"] for c in data["candidates"]}
    for label, c in rows:
        speed = f"{c['speedup_vs_fp32']:.2f}x fp32" if c.get("speedup_vs_fp32") else "-"
        memory = f"{(c.get('peak_memory') or 0) / 2**20:.0f} MiB {c.get('memory_kind', '')}"
        note = c.get("reason") or "; ".join(c.get("notes") or [])
        print(f"    {label:<22} {c['outcome']:<10} {speed:<12} {memory:<24} {note[:150]}")
        if label != "fp32" and c["outcome"] not in RUN_OK:
            bad += 1
    for mode in expected:
        if mode not in seen:
            print(f"    {mode:<22} missing from the trial's result")
            bad += 1
    return 1 if bad else 0


def tune(tune_json: str) -> int:
    data = json.loads(Path(tune_json).read_text())
    speed = data.get("speedup_vs_fp32") or 0.0
    print(f"winner {data.get('winner_label')} ({speed:.2f}x fp32), {data.get('trials_run')} trials, "
          f"{data.get('wall_s', 0):.0f} s; {data.get('stop_reason', '')[:100]}")
    return 0 if data.get("winner") else 1


sys.exit(globals()[sys.argv[1]](*sys.argv[2:]))
PY
check() { "$PY" "$WORK/check.py" "$@"; }

# --- the GPU, or a loud stop -------------------------------------------------------------
no_gpu() {
    echo "gpu_check: FAIL: no usable GPU here: $1. This check needs a CUDA GPU; on a CPU," \
        "run scripts/gpu_check_dryrun.sh (or scripts/gpu_check.sh --dry-run)." >&2
    record gpu 1 0 FAIL "no usable GPU: $1"
    write_summary >&2
    exit 1
}
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -n)  $(uname -srm)"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
} >> "$ENV"
if ((DRY_RUN)); then
    record gpu - 0 ok "dry run on a CPU: the CUDA-only parts are left out"
else
    command -v nvidia-smi > /dev/null || no_gpu "nvidia-smi is not on PATH"
    timeout 60 nvidia-smi > "$WORK/nvidia-smi.txt" 2>&1 || no_gpu "nvidia-smi failed: $(tail -n 1 "$WORK/nvidia-smi.txt")"
    cat "$WORK/nvidia-smi.txt" >> "$ENV"
    if ! gpu=$(timeout 120 "$PY" -c '
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}")
' 2>> "$LOG"); then
        no_gpu "torch sees no CUDA device ($(tail -n 1 "$LOG"))"
    fi
    echo "gpu: $gpu" >> "$ENV"
    record gpu 0 "$(($(date +%s) - START))" ok "$gpu"
fi

# --- the wheels the machine lacks ----------------------------------------------------------
if compgen -G ".whl/*.whl" > /dev/null; then
    # shellcheck disable=SC2016 # $1 and $2 are the inner shell's arguments
    run_step wheels 180 "$WORK/wheels.txt" bash -c '
        PYTHON="$1" bash scripts/gpu_wheels.sh --check &&
        "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" .whl/*.whl' \
        _ "$PY" "$SITE"
    cat "$WORK/wheels.txt" >> "$ENV"
    if ((RC == 0)); then
        wheels=(.whl/*.whl)
        record wheels 0 "$SECS" ok "${#wheels[@]} wheels from .whl/ into $SITE (the set checked against scripts/gpu_wheels.txt)"
    else
        record wheels "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/wheels.err")"
    fi
else
    record wheels 1 0 FAIL "no wheels in .whl/: run scripts/gpu_wheels.sh where there is network, and carry .whl"
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

run_step requirements 60 "$WORK/requirements.txt" "$PY" "$WORK/check.py" requirements "$SITE"
cat "$WORK/requirements.txt" >> "$ENV"
record requirements "$RC" "$SECS" "$( ((RC == 0)) && echo ok || echo FAIL)" "$(timed_out)$(tail -n 1 "$WORK/requirements.txt")"

run_step imports 120 "$WORK/imports.txt" "$PY" "$WORK/check.py" imports
cat "$WORK/imports.txt" >> "$ENV"
record imports "$RC" "$SECS" "$( ((RC == 0)) && echo ok || echo FAIL)" "$(timed_out)$(tail -n 1 "$WORK/imports.txt")"

# --- probe: the modes to try come from it ---------------------------------------------------
if ((DRY_RUN)); then probe_args=(--json); else probe_args=(--json --bench); fi
run_step probe 150 "$OUT/probe.json" "$PY" -m advisor.cli probe "${probe_args[@]}"
TRIAL_MODES=() TUNE_MODES=() FP8_TORCHAO="unverified: the probe failed" FP8_TE="unverified: the probe failed"
if ((RC == 0)) && check modes "$OUT/probe.json" "$KIND" > "$WORK/modes.txt" 2>> "$LOG"; then
    read -r -a TRIAL_MODES < <(sed -n 1p "$WORK/modes.txt") || true
    read -r -a TUNE_MODES < <(sed -n 2p "$WORK/modes.txt") || true
    FP8_TORCHAO=$(sed -n 3p "$WORK/modes.txt")
    FP8_TE=$(sed -n 4p "$WORK/modes.txt")
    record probe 0 "$SECS" ok "trial: fp32 ${TRIAL_MODES[*]}; tune: ${TUNE_MODES[*]}; fp8-torchao: $FP8_TORCHAO"
else
    record probe "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/probe.err" 2>/dev/null)"
fi

# --- the GPU tests ----------------------------------------------------------------------------
if ((DRY_RUN)); then
    run_step tests 120 "$OUT/tests.txt" "$PY" -m pytest -q -p no:cacheprovider --timeout 150 --collect-only tests/gpu
else
    run_step tests 210 "$OUT/tests.txt" "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 150 tests/gpu
fi
record tests "$RC" "$SECS" "$( ((RC == 0)) && echo ok || echo FAIL)" "$(timed_out)pytest: $(tail -n 1 "$OUT/tests.txt")"

# --- trials: `mpadvise trial` of some modes on examples/mlp.py, each judged --------------------
# trial_step NAME WHAT MLP_ARGS_VAR MODE...: a trial of MODEs with the MLP arguments held in the
# array named MLP_ARGS_VAR; records NAME ok when every mode ran to a verdict.
trial_step() {
    local name=$1 what=$2
    local -n mlp_args=$3
    shift 3
    local modes=("$@") args=() judged=1
    for mode in "${modes[@]}"; do args+=(-m "$mode"); done
    run_step "$name" 150 "$OUT/$name.json" "$PY" -m advisor.cli trial examples/mlp.py "${args[@]}" \
        "${STEPS[@]}" --timeout "$TRIAL_TIMEOUT" --device "$DEVICE" --json -- "${mlp_args[@]}"
    : > "$WORK/judge.txt"
    [ -s "$OUT/$name.json" ] && judged=0 && check judge "$OUT/$name.json" "${modes[@]}" > "$WORK/judge.txt" 2>> "$LOG" || judged=$?
    # Exit 3 says a candidate was judged unstable: a verdict, which the rows below show.
    if ((RC == 0 || RC == 3)) && ((judged == 0)); then
        record "$name" "$RC" "$SECS" ok "$what on examples/mlp.py ${mlp_args[*]} ran to a verdict"
    else
        record "$name" "$RC" "$SECS" FAIL "$(timed_out)$what did not run to a verdict: $(tail -n 1 "$WORK/$name.err")"
    fi
    while IFS= read -r line; do ROWS+=("$line"); done < "$WORK/judge.txt"
}

# Every supported mode.
if ((${#TRIAL_MODES[@]})); then
    trial_step trial "fp32 and ${#TRIAL_MODES[@]} modes" MLP "${TRIAL_MODES[@]}"
else
    : > "$OUT/trial.json"
    record trial - 0 FAIL "no modes to trial: the probe failed"
fi

# FP8: torchao on a wide MLP; Transformer Engine only where it is installed.
fp8_modes=()
if [ "$FP8_TORCHAO" = run ]; then fp8_modes+=(fp8-torchao); fi
if [ "$FP8_TE" = run ]; then fp8_modes+=(fp8-te); fi
if ((${#fp8_modes[@]})); then
    trial_step fp8 "${fp8_modes[*]}" FP8_MLP "${fp8_modes[@]}"
else
    : > "$OUT/fp8.json"
fi
if [ "$FP8_TORCHAO" != run ]; then
    # torchao travels with the wheels, so on a GPU with FP8 it must run.
    record fp8-torchao - 0 FAIL "did not run: ${FP8_TORCHAO#unverified: }"
fi
if [ "$FP8_TE" != run ]; then
    record fp8-te - 0 unverified "Transformer Engine is not installed here and builds from source (nvcc, longer than this check may take): ${FP8_TE#unverified: }"
fi

# --- a short tune ---------------------------------------------------------------------------
left=$((DEADLINE - $(date +%s)))
time_budget=$((left - 120 < 90 ? left - 120 : 90))  # the re-measurement of close finalists comes after
if ((time_budget < 20)); then time_budget=20; fi
tune_args=()
for mode in "${TUNE_MODES[@]}"; do tune_args+=(-m "$mode"); done
run_step tune 240 "$OUT/tune.json" "$PY" -m advisor.cli tune examples/mlp.py "${tune_args[@]}" --trials 4 \
    "${STEPS[@]}" --timeout "$TRIAL_TIMEOUT" --time-budget "$time_budget" --device "$DEVICE" --no-cache \
    --out "$WORK/mlp.mpadvise.toml" --json -- "${TUNE_MLP[@]}"
if ((RC == 0)) && check tune "$OUT/tune.json" > "$WORK/tune-line.txt" 2>> "$LOG"; then
    record tune 0 "$SECS" ok "$(cat "$WORK/tune-line.txt")"
else
    record tune "$RC" "$SECS" FAIL "$(timed_out)$(tail -n 1 "$WORK/tune.err")"
fi
if [ -f "$WORK/mlp.mpadvise.toml" ]; then
    { echo "=== the tuned config"; cat "$WORK/mlp.mpadvise.toml"; } >> "$LOG"
fi

cap "$LOG" 4000000
cap "$ENV" 1000000
write_summary
((${#FAILED[@]} == 0))
