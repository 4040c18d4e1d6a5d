"""Per-step cost of the runtime guard: the same training loop through ``load_policy()`` with the
guard off and with it on (``warn``), side by side in one process.

Two models, built alike from one seed, train on the same data; each round times a window of
steps of one and then of the other, alternating which goes first, so that the machine's pace
hits both alike. The table gives, per mode, the median step time of each and the median over
rounds of the per-round ratio (guard on / off), with its quartiles. The guard reads the loss
value once per optimizer step (the one sync the loss value needs), and a GradScaler's scale only
on a skipped step; the aim is at most 1% of the step.

    .venv/bin/python scripts/bench_guard_overhead.py [--rounds 21] [--steps 30] [--modes fp32 fp16-mixed]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor


def _model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def _runner(mode: str, guard: str, width: int, batch: int):
    mp = advisor.load_policy(advisor.Policy(mode=mode), guard=guard)
    net = _model(width)
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    x = torch.randn(batch, 256)
    y = (x @ torch.randn(256, 10)).argmax(dim=1)

    def window(steps: int) -> float:
        """The median seconds of ``steps`` optimizer steps."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            xb, yb = mp.to_device(x, y)
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, optimizer)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["fp32", "fp16-mixed"])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    logging.getLogger("mpadvise").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes:
        off, on = _runner(mode, "off", args.width, args.batch), _runner(mode, "warn", args.width, args.batch)
        off(10), on(10)  # warm-up
        pairs = []
        for i in range(args.rounds):
            first, second = (off, on) if i % 2 == 0 else (on, off)
            a, b = first(args.steps), second(args.steps)
            pairs.append((a, b) if first is off else (b, a))
        ratios = sorted(b / a for a, b in pairs)
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        rows.append({"mode": mode, "off_ms": statistics.median(a for a, _ in pairs) * 1e3,
                     "warn_ms": statistics.median(b for _, b in pairs) * 1e3,
                     "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3})
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} rounds of {args.steps} steps")
    print(f"{'mode':<12} {'off ms':>8} {'warn ms':>8} {'warn/off':>9} {'quartiles':>15}")
    for row in rows:
        print(f"{row['mode']:<12} {row['off_ms']:8.3f} {row['warn_ms']:8.3f} {row['ratio']:9.3f} "
              f"{row['ratio_q1']:7.3f}-{row['ratio_q3']:.3f}")
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump({"rows": rows, "args": vars(args)}, file, indent=2)


if __name__ == "__main__":
    main()
