#!/usr/bin/env bash
# Create .venv on first use and install the project with its test extras and the CPU build of torch.
# Safe to run again: it only reinstalls when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MPADVISE_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.mpadvise-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch first, pinned: on these machines this version resolves to the CPU build.
    # pyproject.toml keeps a range; only the install step pins.
    "$VENV/bin/python" -m pip install -q "torch==${MPADVISE_TORCH:-2.13.0}"
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
    # DeepSpeed, so that `mpadvise export --to deepspeed` is checked by DeepSpeed's own config
    # parser. Its sdist imports torch to build, so it builds against the torch above (no build
    # isolation, no ops compiled), and --no-deps keeps pip from touching torch; the three
    # modules it imports on a CPU come next. Where it does not install, that test skips.
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps "deepspeed==0.19.8" \
        hjson einops msgpack || echo "bootstrap: deepspeed did not install; its config test will skip"
    # torchtitan, so that `mpadvise export --to torchtitan` is loaded by its own ConfigManager.
    # Its full dependency list (datasets, wandb, tensorboard, ...) adds minutes and 400 MB for a
    # config check; the config module needs only tyro and spmd_types. Where it does not install,
    # that test skips.
    "$VENV/bin/python" -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" \
        && "$VENV/bin/python" -m pip install -q "tyro==1.0.17" \
        || echo "bootstrap: torchtitan did not install; its config test will skip"
    touch "$stamp"
fi
