#!/usr/bin/env bash
# Prove here, before the one run on the GPU machine, that the wheels in .whl/ are complete and
# that scripts/gpu_check.sh runs: in a fresh CPython 3.12 virtualenv that holds only what the
# GPU machine has (torch 2.11.0 and the packages of its image the check relies on, as PyPI
# served them when that image was built), install .whl/ exactly as the check does and run every
# step that needs no CUDA (gpu_check.sh --dry-run): the wheels' requirements, imports of every
# module, probe --json, a trial of every mode and a short tune of examples/mlp.py on the CPU,
# fp8-torchao (emulated), and pytest collection of tests/gpu.
#
#   bash scripts/gpu_check_dryrun.sh              needs network the first time (PyPI), then none
#   bash scripts/gpu_check_dryrun.sh --only lm    arguments go to gpu_check.sh (--only, --skip)
#
# A CPU is slower than the GPU, and a loaded one much slower (importing torch alone has taken
# 112 s on a busy 2-core machine): the check scales every step's limit, each trial's timeout
# and its budget by how long importing torch takes here (MPADVISE_GPU_CHECK_SCALE=auto; set a
# whole number to fix it).
#
# The virtualenv is kept in $MPADVISE_PROOF_VENV (default: $TMPDIR/mpadvise-gpu-proof) and
# rebuilt when the machine's package list in scripts/gpu_wheels.txt changes. Results go to
# $OUT (default ./gpu-check-dry-run), the same files the check writes on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MPADVISE_PROOF_VENV:-${TMPDIR:-/tmp}/mpadvise-gpu-proof}
OUT=${OUT:-gpu-check-dry-run}
HOST_PY=${PYTHON:-python3}

find_python312() {
    local candidate
    for candidate in "${PYTHON312:-}" python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12 \
        "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' 2> /dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    if command -v uv > /dev/null && candidate=$(uv python find 3.12 2> /dev/null); then
        echo "$candidate"
        return 0
    fi
    return 1
}

# PyPI alone, with no local wheel folders or constraints, so that upload dates decide versions.
pypi() {
    env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
        "$VENV/bin/python" -m pip "$@"
}

echo "== the wheels: .whl/ as scripts/gpu_wheels.txt pins it, and its closure"
PYTHON=$HOST_PY bash scripts/gpu_wheels.sh

machine_date=$(sed -n 's/^date: *//p' scripts/gpu_wheels.txt)
needs=$(PYTHON=$HOST_PY bash scripts/gpu_wheels.sh --machine-needs | grep -v '^pip$')
stamp=$(printf '%s\n%s\n' "$machine_date" "$needs" | sha256sum | cut -c1-16)
if [ ! -f "$VENV/.stamp" ] || [ "$(cat "$VENV/.stamp")" != "$stamp" ]; then
    py312=$(find_python312) || {
        echo "gpu_check_dryrun: no CPython 3.12 here (the GPU machine's Python): install python3.12" \
            "(Debian: apt-get install python3.12 python3.12-venv) or set PYTHON312" >&2
        exit 1
    }
    echo "== a fresh virtualenv in $VENV from $py312 ($("$py312" -V)), with the machine's packages as of $machine_date:"
    echo "$needs" | tr '\n' ' '
    echo
    rm -rf "$VENV"
    "$py312" -m venv "$VENV"
    pypi install -q --upgrade pip
    # shellcheck disable=SC2086 # one requirement a word
    pypi install -q --uploaded-prior-to "${machine_date}T00:00:00Z" $needs
    echo "$stamp" > "$VENV/.stamp"
fi

echo "== the virtualenv holds only packages the GPU machine has"
"$VENV/bin/python" -I - <<'PY'  # -I: this folder (its egg-info) is no package of the machine
import importlib.metadata as md
import re
import sys
from pathlib import Path

def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

text = Path("scripts/gpu_wheels.txt").read_text()
machine_section = text.split("[machine]", 1)[1]
machine = {canon(token.split("==")[0]) for line in machine_section.splitlines()
           for token in line.split("#", 1)[0].split() if ":" not in line}
installed = {canon(d.metadata["Name"]): d.version for d in md.distributions()}
extra = sorted(set(installed) - machine)
print(f"Python {sys.version.split()[0]}; {len(installed)} distributions; torch {installed.get('torch')}, "
      f"numpy {installed.get('numpy')}, typer {installed.get('typer')}, click {installed.get('click')}, "
      f"typing-extensions {installed.get('typing-extensions')}")
if extra:
    sys.exit(f"gpu_check_dryrun: the virtualenv holds what the GPU machine lacks: {', '.join(extra)}")
PY

echo "== scripts/gpu_check.sh --dry-run with $("$VENV/bin/python" -V) from $VENV"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
PATH=$VENV/bin:$PATH PYTHON=$VENV/bin/python3 MPADVISE_GPU_SITE=$site/site OUT=$OUT \
    MPADVISE_GPU_CHECK_SCALE=${MPADVISE_GPU_CHECK_SCALE:-auto} bash scripts/gpu_check.sh --dry-run "$@"
