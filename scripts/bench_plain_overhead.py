"""Per-step overhead of the plain-torch adapter against the same policy applied by hand with
``load_policy()``, measured side by side.

Two scripts train the same model on the same data for the same steps: a plain loop (no line of
mpadvise) run through the adapter as ``mpadvise run`` runs it, and the same loop written with
``advisor.load_policy()`` (``mp.setup``, ``mp.autocast``, ``mp.step``), given the same config
file. Each process times its own steps after a warm-up and prints their median. The two are
run interleaved (alternating which goes first each round), one process each, and the table
gives, per mode, the median over rounds of each and of the per-round ratio (adapter / by hand),
with the quartiles of that ratio.

    .venv/bin/python scripts/bench_plain_overhead.py [--rounds 9] [--steps 60] [--modes fp32 bf16-mixed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = """
import json, statistics, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F
WIDTH, STEPS, WARMUP, BATCH = {width}, {steps}, 10, {batch}
torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.randn(64 * BATCH, 256)
y = (x @ torch.randn(256, 10)).argmax(dim=1)
net = nn.Sequential(nn.Linear(256, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 10))
times = []
"""
PLAIN = COMMON + """
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
for i in range(STEPS):
    start = time.perf_counter()
    xb, yb = x[i % 64 * BATCH:(i % 64 + 1) * BATCH], y[i % 64 * BATCH:(i % 64 + 1) * BATCH]
    loss = F.cross_entropy(net(xb).float(), yb)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    loss.item()
    times.append(time.perf_counter() - start)
print(json.dumps({{"step_s": statistics.median(times[WARMUP:])}}))
"""
BY_HAND = COMMON + """
import advisor
mp = advisor.load_policy()
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
with mp:
    for i in range(STEPS):
        start = time.perf_counter()
        xb, yb = x[i % 64 * BATCH:(i % 64 + 1) * BATCH], y[i % 64 * BATCH:(i % 64 + 1) * BATCH]
        xb, yb = mp.to_device(xb, yb)
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        loss.item()
        times.append(time.perf_counter() - start)
print(json.dumps({{"step_s": statistics.median(times[WARMUP:])}}))
"""


def run_one(argv: list[str], env: dict[str, str]) -> float:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["step_s"])


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="samples per step (1 with a small width: the hooks' own cost)")
    parser.add_argument("--modes", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    from policies import Policy

    work = Path(tempfile.mkdtemp(prefix="bench-plain-"))
    plain, by_hand = work / "plain_loop.py", work / "by_hand.py"
    plain.write_text(PLAIN.format(width=args.width, steps=args.steps, batch=args.batch))
    by_hand.write_text(BY_HAND.format(width=args.width, steps=args.steps, batch=args.batch))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(work / "cache"),
           "MPADVISE_HOME": str(work / "home")}
    rows = []
    print(f"{platform.processor() or platform.machine()}, torch {__import__('torch').__version__}; "
          f"MLP width {args.width}, batch {args.batch}, {args.steps} steps ({args.steps - 10} timed) per process, "
          f"{args.rounds} interleaved rounds")
    print(f"{'mode':<12} {'adapter ms':>10} {'by hand ms':>10} {'ratio':>7} {'ratio IQR':>15}")
    for mode in args.modes:
        config = work / f"{mode}.mpadvise.toml"
        Policy(mode=mode).save(config)
        adapter_env = {**env, "MPADVISE_RUN_POLICY": str(config), "MPADVISE_RUN_SOURCE": "bench"}
        hand_env = {**env, "MPADVISE_POLICY": str(config)}
        adapter_argv = [sys.executable, "-m", "advisor.frameworks._boot", "torch", str(plain)]
        hand_argv = [sys.executable, str(by_hand)]
        adapter, hand, ratios = [], [], []
        for r in range(args.rounds):
            pair = [(adapter_argv, adapter_env, adapter), (hand_argv, hand_env, hand)]
            for argv, e, out in pair if r % 2 == 0 else reversed(pair):
                out.append(run_one(argv, e))
            ratios.append(adapter[-1] / hand[-1])
        low, high = quartiles(ratios)
        row = {"mode": mode, "adapter_step_s": statistics.median(adapter), "by_hand_step_s": statistics.median(hand),
               "ratio": statistics.median(ratios), "ratio_q1": low, "ratio_q3": high, "rounds": args.rounds}
        rows.append(row)
        print(f"{mode:<12} {row['adapter_step_s'] * 1e3:>10.3f} {row['by_hand_step_s'] * 1e3:>10.3f} "
              f"{row['ratio']:>7.3f} {low:>7.3f}-{high:<7.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "width": args.width, "batch": args.batch, "steps": args.steps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
