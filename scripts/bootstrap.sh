#!/usr/bin/env bash
# Create .venv on first use and install the project with its test extras and the CPU build of torch.
# Safe to run again: it only reinstalls when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MPADVISE_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.mpadvise-installed"
if [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ]; then
    exit 0
fi
echo "mpadvise: installing torch (CPU build) and the project with its test extras into $VENV (first run only; a few minutes)" >&2
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# torch first, pinned: on these machines this version resolves to the CPU build.
# pyproject.toml keeps a range; only the install step pins.
"$VENV/bin/python" -m pip install -q "torch==${MPADVISE_TORCH:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
# The DeepSpeed export check: `mpadvise export --to deepspeed` is read by DeepSpeed's own config
# parser. It installs whole, with its own dependencies, so pip has nothing to complain about.
# Its sdist imports torch to build: it builds against the torch above (no build isolation, no ops
# compiled). Where it does not install, its test skips with the reason. torchtitan is not
# installed: its dependencies (datasets) pin a huggingface-hub older than transformers needs, so
# its config test skips unless it is installed by hand.
echo "mpadvise: installing DeepSpeed for the export check" >&2
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --no-build-isolation "deepspeed==0.19.8" einops \
    || echo "bootstrap: deepspeed did not install; its config test will skip" >&2
touch "$stamp"
