#!/usr/bin/env bash
# The checks that need a GPU, as one short run: the GPU tests, the probe with its matmul
# benchmark, a trial and a short tune of an example. Results go to $OUT (or ./gpu-check).
# Wheels for packages the GPU machine lacks (torchao, optuna, ...) can be placed in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export MPADVISE_HOME=$(mktemp -d)
PY=${PYTHON:-python3}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -m pytest -q -rs tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
$PY -m advisor.cli probe --json --bench > "$OUT/probe.json" 2> "$OUT/probe.err"
$PY -m advisor.cli trial examples/mlp.py -m bf16-mixed -m fp16-mixed -m tf32 --steps 60 --json \
    -- --width 4096 --batch-size 256 > "$OUT/trial.json" 2> "$OUT/trial.err"
$PY -m advisor.cli tune examples/mlp.py --trials 8 --steps 40 --json --out "$OUT/mlp.mpadvise.toml" \
    -- --width 4096 --batch-size 256 > "$OUT/tune.json" 2> "$OUT/tune.err"
echo "exit codes: see $OUT; done"
