"""Whether this host's speed moves in spells that the guest cannot see, and how far they move
bf16's speed-up over fp32.

One process trains two copies of examples/mlp.py's network (a batch of 128, 256 -> 512 -> 512
-> 10, AdamW) on fixed synthetic batches: one in fp32, one with bf16 weights and inputs. It
alternates windows of ``--steps`` steps of each, in ABBA order, for every thread count in
``--threads``, so that every window of one kind has a window of the other beside it, a
fraction of a second apart, in the same process. For each window it records the median step
time, the process's CPU time over the window's wall time (2.0: both of two threads ran the whole
window), and the idle and steal time of all CPUs from /proc/stat (another process, or a
hypervisor that reports taking the CPU away).

A spell that slows both kinds alike leaves their ratio alone, and a paired round cancels it. A
spell that slows one kind more moves the ratio itself, and no pairing cancels that. When the
windows slow down while the process keeps all its CPU time and the CPUs show no idle and no
steal, the cause lies outside the guest (a neighbour on the host), and nothing inside it can
see it coming.

    .venv/bin/python scripts/bench_host_regimes.py --pairs 40 --json docs/bench/host-regimes-epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_agreement import machine  # noqa: E402  (scripts/, this script's folder)

from probes import write_file_atomic  # noqa: E402

KINDS = ("fp32", "bf16")


def cpu_ticks() -> dict[str, int]:
    """All CPUs' ticks so far from /proc/stat: in all, idle (with I/O wait), and stolen."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return {"total": sum(fields), "idle": fields[3] + fields[4], "steal": fields[7]}


class Arm:
    """One network, its optimizer and its batches, in fp32 or with bf16 weights."""

    def __init__(self, kind: str, rows: int, width: int, batches: int) -> None:
        import torch
        import torch.nn as nn

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                            nn.Linear(width, 10))
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        self.net = net.to(dtype)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-3)
        self.batches = [(torch.randn(rows, 256).to(dtype), torch.randint(0, 10, (rows,))) for _ in range(batches)]
        self.next = 0

    def step(self) -> float:
        import torch.nn.functional as F

        x, y = self.batches[self.next % len(self.batches)]
        self.next += 1
        start = time.perf_counter()
        loss = F.cross_entropy(self.net(x).float(), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        loss.item()
        return time.perf_counter() - start


def window(arm: Arm, steps: int) -> dict:
    """``steps`` steps of ``arm``: their median time, and what the process and the CPUs did."""
    ticks, cpu, wall = cpu_ticks(), time.process_time(), time.perf_counter()
    times = [arm.step() for _ in range(steps)]
    wall, cpu, after = time.perf_counter() - wall, time.process_time() - cpu, cpu_ticks()
    total = max(1, after["total"] - ticks["total"])
    return {"median_ms": round(statistics.median(times) * 1e3, 4), "cpu_per_wall": round(cpu / wall, 3),
            "idle": round((after["idle"] - ticks["idle"]) / total, 4),
            "steal": round((after["steal"] - ticks["steal"]) / total, 4)}


def summary(rows: list[dict]) -> dict:
    """One thread count's windows, side by side."""
    fp32 = [r["fp32"]["median_ms"] for r in rows]
    bf16 = [r["bf16"]["median_ms"] for r in rows]
    ratios = [r["ratio"] for r in rows]
    windows = [r[k] for r in rows for k in KINDS]
    return {
        "fp32_ms": [min(fp32), statistics.median(fp32), max(fp32)],
        "bf16_ms": [min(bf16), statistics.median(bf16), max(bf16)],
        "ratio": [min(ratios), statistics.median(ratios), max(ratios)],
        "fp32_max_over_min": round(max(fp32) / min(fp32), 3),
        "ratio_max_over_min": round(max(ratios) / min(ratios), 3),
        "cpu_per_wall": [min(w["cpu_per_wall"] for w in windows), statistics.median(w["cpu_per_wall"] for w in windows)],
        "idle_max": max(w["idle"] for w in windows),
        "steal_max": max(w["steal"] for w in windows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40, help="windows of each kind per thread count")
    parser.add_argument("--steps", type=int, default=100, help="steps per window")
    parser.add_argument("--threads", default=None,
                        help="thread counts, comma-separated (default: torch's own count, then 1)")
    parser.add_argument("--rows", type=int, default=128, help="the batch")
    parser.add_argument("--width", type=int, default=512, help="the hidden layers' width")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    for name in ("pairs", "steps", "rows", "width"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    if not Path("/proc/stat").is_file():
        raise SystemExit("this bench reads /proc/stat: Linux only")
    import torch

    own = torch.get_num_threads()
    try:
        counts = [int(v) for v in args.threads.split(",")] if args.threads else sorted({own, 1}, reverse=True)
    except ValueError:
        raise SystemExit(f"--threads must be whole numbers separated by commas, got {args.threads!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit("--threads must name at least one count, each at least 1")
    arms = {kind: Arm(kind, args.rows, args.width, batches=16) for kind in KINDS}
    report: dict = {"steps": args.steps, "rows": args.rows, "width": args.width, "threads": counts,
                    "load_average_before": os.getloadavg(), "rows_by_threads": {str(t): [] for t in counts}}
    for threads in counts:  # oneDNN builds its kernels on first use, per thread count
        torch.set_num_threads(threads)
        for arm in arms.values():
            for _ in range(10):
                arm.step()
    start = time.monotonic()
    for i in range(args.pairs):
        for threads in counts:
            torch.set_num_threads(threads)
            order = KINDS if i % 2 == 0 else KINDS[::-1]
            row: dict = {"at_s": round(time.monotonic() - start, 2)}
            for kind in order:
                row[kind] = window(arms[kind], args.steps)
            row["ratio"] = round(row["fp32"]["median_ms"] / row["bf16"]["median_ms"], 4)
            report["rows_by_threads"][str(threads)].append(row)
            print(f"{row['at_s']:6.1f} s  {threads} thread(s)  fp32 {row['fp32']['median_ms']:6.3f} ms  "
                  f"bf16 {row['bf16']['median_ms']:6.3f} ms  ratio {row['ratio']:.3f}  "
                  f"cpu/wall {row['fp32']['cpu_per_wall']:.2f} {row['bf16']['cpu_per_wall']:.2f}  "
                  f"idle {max(row['fp32']['idle'], row['bf16']['idle']):.3f}  "
                  f"steal {max(row['fp32']['steal'], row['bf16']['steal']):.3f}", flush=True)
    report["machine"] = machine()
    report["summary"] = {str(t): summary(report["rows_by_threads"][str(t)]) for t in counts}
    print("threads  fp32 window ms (min/median/max)  max/min  fp32/bf16 ratio (min/median/max)  max/min  "
          "cpu/wall (min/median)  idle max  steal max")
    for t in counts:
        s = report["summary"][str(t)]
        print(f"{t:7d}  {s['fp32_ms'][0]:6.3f} {s['fp32_ms'][1]:6.3f} {s['fp32_ms'][2]:6.3f}        "
              f"{s['fp32_max_over_min']:5.2f}  {s['ratio'][0]:5.3f} {s['ratio'][1]:5.3f} {s['ratio'][2]:5.3f}"
              f"                {s['ratio_max_over_min']:5.2f}  {s['cpu_per_wall'][0]:.2f} {s['cpu_per_wall'][1]:.2f}"
              f"              {s['idle_max']:.3f}     {s['steal_max']:.3f}")
    if args.json:
        write_file_atomic(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
