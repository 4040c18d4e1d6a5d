"""How far this host's own bf16 speed-up moves over time, with no tune, no trial and no script.

A paired round of a tune compares two trials run seconds apart. When the machine's speed moves
alike for both, the pair cancels it; when the *ratio* between two precisions moves, no pairing
can. This bench measures that ratio directly: the time of a matmul at the demo's shapes
(examples/mlp.py: a batch of 128 through a 512-by-512 layer, ``--rows``/``--width``) in fp32
over its time in bf16, interleaved inside one process, median over ``--repeats`` alternations.
Each sample runs in a fresh interpreter (as a cold trial) or in a child forked from a parent
that imported torch and ran nothing (as a warm trial), the two in ABBA order, so that a
difference between them shows beside the drift of both. Prints each sample with its time since
the start; writes JSON (``--json``).

    .venv/bin/python scripts/bench_host_drift.py --samples 40 --json docs/bench/host-drift-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_agreement import machine  # noqa: E402  (scripts/, this script's folder)

from probes import write_file_atomic  # noqa: E402


def matmul_ratio(rows: int, width: int, repeats: int) -> float:
    """The median, over ``repeats`` alternations, of fp32's matmul time over bf16's."""
    import torch

    a32, w32 = torch.randn(rows, width), torch.randn(width, width)
    a16, w16 = a32.bfloat16(), w32.bfloat16()

    def seconds(a: torch.Tensor, w: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            a @ w
        return (time.perf_counter() - start) / n

    for _ in range(3):  # oneDNN builds its kernels on first use
        seconds(a32, w32, 5)
        seconds(a16, w16, 5)
    return statistics.median(seconds(a32, w32, 20) / seconds(a16, w16, 20) for _ in range(repeats))


def fresh(rows: int, width: int, repeats: int) -> float:
    """One sample in a fresh interpreter."""
    code = f"import bench_host_drift as b; print(b.matmul_ratio({rows}, {width}, {repeats}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                         check=True, timeout=600)
    return float(out.stdout.strip())


def forked(rows: int, width: int, repeats: int) -> float:
    """One sample in a child forked from this process (which imported torch and ran nothing)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running the parent's exit handlers
        os.close(read)
        try:
            os.write(write, repr(matmul_ratio(rows, width, repeats)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    if not text:
        raise SystemExit("a forked sample ended without a result")
    return float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40, help="samples in all, fresh and forked alternating")
    parser.add_argument("--rows", type=int, default=128, help="the batch: rows of the activations")
    parser.add_argument("--width", type=int, default=512, help="the layer's width")
    parser.add_argument("--repeats", type=int, default=15, help="fp32/bf16 alternations per sample")
    parser.add_argument("--gap", type=float, default=4.0,
                        help="seconds to wait between samples (about a cold trial's start-up, so the samples span a tune)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    for name in ("samples", "rows", "width", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    if not args.gap >= 0:
        raise SystemExit("--gap must be a number of seconds >= 0")
    import torch  # noqa: F401  (imported before any fork, as the warm launcher's server does)

    report: dict = {"rows": args.rows, "width": args.width, "repeats": args.repeats, "gap_s": args.gap,
                    "load_average_before": os.getloadavg(), "samples": []}
    start = time.monotonic()
    for i in range(args.samples):
        if i:
            time.sleep(args.gap)
        kind = ("fresh", "forked")[i % 2] if (i // 2) % 2 == 0 else ("forked", "fresh")[i % 2]
        ratio = (fresh if kind == "fresh" else forked)(args.rows, args.width, args.repeats)
        at = time.monotonic() - start
        report["samples"].append({"kind": kind, "at_s": round(at, 2), "ratio": round(ratio, 4)})
        print(f"{at:7.1f} s  {kind:6}  fp32/bf16 matmul time {ratio:.3f}", flush=True)
    report["machine"] = machine()  # after the forks: the CPU probe may run torch operations
    ratios = [s["ratio"] for s in report["samples"]]
    report["range"] = [min(ratios), max(ratios)]
    for kind in ("fresh", "forked"):
        mine = [s["ratio"] for s in report["samples"] if s["kind"] == kind]
        if mine:
            report[f"{kind}_median"] = statistics.median(mine)
            print(f"{kind}: median {statistics.median(mine):.3f}, range {min(mine):.3f} to {max(mine):.3f}")
    print(f"all: range {min(ratios):.3f} to {max(ratios):.3f} (max/min {max(ratios) / min(ratios):.2f})")
    if args.json:
        write_file_atomic(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
