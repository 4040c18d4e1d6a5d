"""bf16 against fp32 on this CPU with AMX, and with oneDNN capped below AMX.

The safe default on a CPU depends on its ISA: bf16-mixed with AMX-BF16, fp32 with only
AVX512-BF16 or less. One machine can measure every case, because oneDNN, which runs torch's
bf16 matmuls on a CPU, obeys ``ONEDNN_MAX_CPU_ISA``: capped at ``AVX512_CORE_BF16`` it uses the
AVX512-BF16 dot products and no AMX tiles, as a CPU without AMX would.

Each round runs one subprocess per ISA cap, in an order that alternates between rounds; each
subprocess times a square matmul and an MLP training step in fp32 and bf16-mixed (one torch
thread), and the table reports medians of the per-round fp32/bf16 time ratios.

    .venv/bin/python scripts/bench_cpu_isa.py [--rounds 5] [--json docs/bench/cpu_isa.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CAPS = ("default", "AVX512_CORE_BF16", "AVX512_CORE")

CHILD = r"""
import json, statistics, time, torch
import torch.nn as nn, torch.nn.functional as F
import advisor
torch.set_num_threads(1)
torch.manual_seed(0)

def median_time(fn, repeats=7, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
out = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    x, y = a.to(dtype), b.to(dtype)
    out[f"matmul_{name}_s"] = median_time(lambda: x @ y)

def step_time(mode):
    net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))
    mp = advisor.load_policy(advisor.Policy(mode=mode), device="cpu")
    model, opt = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    xb, yb = torch.randn(256, 512), torch.randint(0, 10, (256,))
    def step():
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, opt)
    return median_time(step, repeats=5, warmup=2)

out["step_fp32_s"] = step_time("fp32")
out["step_bf16_mixed_s"] = step_time("bf16-mixed")
print(json.dumps(out))
"""


def run_child(cap: str) -> dict[str, float]:
    env = dict(os.environ, MPADVISE_QUIET="1")
    if cap != "default":
        env["ONEDNN_MAX_CPU_ISA"] = cap
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, float]]] = {cap: [] for cap in CAPS}
    for r in range(args.rounds):
        for cap in CAPS if r % 2 == 0 else reversed(CAPS):
            runs[cap].append(run_child(cap))

    import probes

    profile = probes.cpu_profile()
    print(f"machine: {profile.name}, {profile.cores} cores, flags {', '.join(profile.cpu_flags)}; "
          f"torch {profile.torch_version}, 1 thread, {args.rounds} interleaved rounds")
    print(f"{'oneDNN ISA cap':<18} {'matmul fp32/bf16':>17} {'MLP step fp32/bf16-mixed':>25}")
    rows = []
    for cap in CAPS:
        matmul = statistics.median(r["matmul_fp32_s"] / r["matmul_bf16_s"] for r in runs[cap])
        step = statistics.median(r["step_fp32_s"] / r["step_bf16_mixed_s"] for r in runs[cap])
        rows.append({"cap": cap, "matmul_speedup_bf16": matmul, "step_speedup_bf16_mixed": step, "runs": runs[cap]})
        print(f"{cap:<18} {matmul:>16.2f}x {step:>24.2f}x")
    if args.json_path:
        probes.write_file_atomic(args.json_path, json.dumps({"machine": profile.to_dict(), "rounds": args.rounds, "rows": rows},
                                                   indent=2))


if __name__ == "__main__":
    main()
