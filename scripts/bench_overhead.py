"""Overhead of mpadvise's training loop against a hand-written torch.autocast + GradScaler loop,
and how a trial's measured step time compares with the same loop timed by hand.

Same model, same data, same mode; the two loops are interleaved in one run (alternating which
goes first each round) so machine noise hits both alike. Prints the median step time of each
and their ratio per mode, and writes the table as JSON.

The second table (``--trial-modes``) runs a trial of a training function (the recorder inside
``step()``, in this process) and the same function through a plain policy, timed by hand,
interleaved the same way: the trial's step time, which excludes the recorder's own work,
should be the step a user times. ``control`` there times two plain runs timed by hand.

    .venv/bin/python scripts/bench_overhead.py [--rounds 15] [--steps 20] [--json out.json]
    .venv/bin/python scripts/bench_overhead.py --modes --trial-rounds 21   # the trial table only
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from advisor import AppliedPolicy, Policy
from advisor.tune._run import FunctionRunner, TrialSettings
from probes import cpu_profile, write_file_atomic

HAND_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
               "bf16-true": torch.bfloat16, "fp16-true": torch.float16}


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


class HandLoop:
    """What a careful user writes by hand for each mode."""

    def __init__(self, mode: str, width: int) -> None:
        self.dtype = HAND_DTYPES[mode]
        self.true = mode.endswith("-true")
        self.model = make_model(width)
        if self.true:
            self.model = self.model.to(self.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler("cpu") if mode == "fp16-mixed" else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.true:
            x = x.to(self.dtype)
        with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None and not self.true):
            loss = F.cross_entropy(self.model(x).float(), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class MpadviseLoop:
    """The same training step through AppliedPolicy."""

    def __init__(self, mode: str, width: int) -> None:
        self.mp = AppliedPolicy(Policy(mode=mode), profile=cpu_profile(), source="bench", device="cpu")
        model = make_model(width)
        self.model, self.opt = self.mp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = self.mp.to_device(x, y)
        with self.mp.autocast():
            loss = F.cross_entropy(self.model(x).float(), y)
        self.mp.step(loss, self.opt)


def timed_steps(loop, batches, steps: int) -> list[float]:
    times = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loop.step(x, y)
        times.append(time.perf_counter() - t0)
    return times


def interleaved_ratio(sides: dict[str, Callable[[], float]], rounds: int) -> dict:
    """Time two sides in ``rounds`` interleaved pairs (their order alternating), and summarise
    the second against the first ("hand"): each side's median in ms, the ratio of the medians,
    the median and interquartile range of the per-round ratios."""
    (base, other), samples = sides, {name: [] for name in sides}
    for r in range(rounds):
        for name in ([base, other] if r % 2 == 0 else [other, base]):
            samples[name].append(sides[name]())
    mid = {name: statistics.median(values) for name, values in samples.items()}
    per_round = [o / b for o, b in zip(samples[other], samples[base])]
    q = statistics.quantiles(per_round, n=4)
    return {
        f"{base}_ms": mid[base] * 1e3,
        f"{other}_ms": mid[other] * 1e3,
        "ratio": mid[other] / mid[base],
        "ratio_median_of_rounds": statistics.median(per_round),
        "ratio_iqr": [q[0], q[2]],
    }


def measure(mode: str, *, width: int, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    torch.manual_seed(1)
    batches = [(torch.randn(batch, 256), torch.randint(0, 10, (batch,))) for _ in range(8)]
    if mode == "control":
        # A/A control: two identical hand-written fp32 loops. Their ratio is the floor of what
        # this measurement can resolve (memory placement alone moves it by a percent or two).
        loops = {"hand": HandLoop("fp32", width), "mpadvise": HandLoop("fp32", width)}
    else:
        loops = {"hand": HandLoop(mode, width), "mpadvise": MpadviseLoop(mode, width)}
    for loop in loops.values():
        timed_steps(loop, batches, warmup)

    def block(name: str) -> float:
        # The median of each short block is one sample: robust to a stray slow step.
        return statistics.median(timed_steps(loops[name], batches, steps))

    return {
        "mode": mode,
        **interleaved_ratio({"hand": lambda: block("hand"), "mpadvise": lambda: block("mpadvise")}, rounds),
        "rounds": rounds,
        "steps_per_round": steps,
    }


# The trial comparison's model: many small layers, so that per-tensor work of the recorder (the
# underflow sampling) would cost the most, as in tests/integration/test_timing_fair.py.
TRIAL_DEPTH, TRIAL_WIDTH, TRIAL_BATCH = 16, 32, 32


def trial_train(mp, marks: list[float] | None = None, steps: int | None = None) -> None:
    """An MLP of many small layers; with ``marks``, each optimizer step's end is timed by hand."""
    torch.manual_seed(0)
    x = torch.randn(TRIAL_BATCH * 8, TRIAL_WIDTH)
    y = (x @ torch.randn(TRIAL_WIDTH, 4)).argmax(1)
    layers: list[nn.Module] = []
    for _ in range(TRIAL_DEPTH):
        layers += [nn.Linear(TRIAL_WIDTH, TRIAL_WIDTH), nn.LayerNorm(TRIAL_WIDTH), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(TRIAL_WIDTH, 4))
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    batch = mp.micro_batch_size(TRIAL_BATCH)
    done = 0
    if marks is not None:
        marks.append(time.perf_counter())
    while True:
        for i in range(0, len(x), batch):
            xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
            with mp.autocast():
                loss = F.cross_entropy(model(xb).float(), yb)
            mp.step(loss, optimizer)
            done += 1
            if marks is not None:
                marks.append(time.perf_counter())
            if steps is not None and done >= steps:
                return


def hand_timed(mode: str, *, warmup: int, steps: int) -> float:
    """Median step time of ``trial_train`` through a plain policy, timed by hand."""
    marks: list[float] = []
    mp = AppliedPolicy(Policy(mode=mode), profile=cpu_profile(), source="bench", device="cpu")
    trial_train(mp, marks, steps=warmup + steps)
    return statistics.median(b - a for a, b in list(zip(marks, marks[1:]))[warmup:])


def trial_timed(mode: str, *, warmup: int, steps: int) -> float:
    """Median of the step times a trial of ``trial_train`` measured."""
    settings = TrialSettings(warmup_steps=warmup, measure_steps=steps, device="cpu")
    result = FunctionRunner(trial_train, settings)(Policy(mode=mode), mode)
    if result.outcome != "ok":
        raise SystemExit(f"the {mode} trial failed ({result.outcome}): {result.reason}")
    return statistics.median(result.step_times[warmup:])


def measure_trial(mode: str, *, rounds: int, steps: int, warmup: int) -> dict:
    """Trial against hand-timed step time for ``mode``, ``rounds`` interleaved pairs of runs."""
    sides: dict[str, Callable[[], float]] = {
        "hand": lambda: hand_timed("fp32" if mode == "control" else mode, warmup=warmup, steps=steps),
        "trial": (lambda: hand_timed("fp32", warmup=warmup, steps=steps)) if mode == "control"
        else (lambda: trial_timed(mode, warmup=warmup, steps=steps)),
    }
    for side in sides.values():
        side()  # one run each first: the allocator and the autocast caches warm up
    return {
        "mode": mode,
        **interleaved_ratio(sides, rounds),
        "rounds": rounds,
        "steps_per_run": steps,
        "warmup_steps": warmup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="*", default=["control", *HAND_DTYPES],
                        help="modes to compare; 'control' times two identical hand-written fp32 loops")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; 1 keeps a shared 2-core machine's noise out of the ratio")
    parser.add_argument("--trial-modes", nargs="*", default=["control", "fp16-mixed", "bf16-mixed"],
                        help="modes whose trial step time is compared with the same loop timed by hand "
                             "('control': two runs timed by hand); none to skip")
    parser.add_argument("--trial-rounds", type=int, default=15, help="interleaved pairs of runs per trial mode")
    parser.add_argument("--trial-steps", type=int, default=30, help="measured steps per run, after 3 warm-up steps")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("mpadvise").setLevel(logging.WARNING)  # not one line per load_policy()

    rows = [measure(m, width=args.width, batch=args.batch, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
            for m in args.modes]
    machine = f"{platform.processor() or platform.machine()}, {cpu_profile().name}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    print(f"machine: {machine}")
    if rows:
        print(f"MLP 256-{args.width}-{args.width}-10, batch {args.batch}, {args.rounds} interleaved rounds x {args.steps} steps")
        print(f"{'mode':<12} {'hand ms':>9} {'mpadvise ms':>12} {'ratio':>7} {'per-round IQR':>16}")
    for r in rows:
        print(f"{r['mode']:<12} {r['hand_ms']:>9.3f} {r['mpadvise_ms']:>12.3f} {r['ratio']:>7.3f} "
              f"{r['ratio_iqr'][0]:>7.3f}-{r['ratio_iqr'][1]:.3f}")
    trial_rows = [measure_trial(m, rounds=args.trial_rounds, steps=args.trial_steps, warmup=3) for m in args.trial_modes]
    if trial_rows:
        if rows:
            print()
        print(f"trial vs hand-timed: MLP of {TRIAL_DEPTH} x (Linear {TRIAL_WIDTH}, LayerNorm, ReLU), batch {TRIAL_BATCH}, "
              f"{args.trial_rounds} interleaved pairs of runs x {args.trial_steps} steps")
        print(f"{'mode':<12} {'hand ms':>9} {'trial ms':>9} {'ratio':>7} {'per-pair IQR':>16}")
        for r in trial_rows:
            print(f"{r['mode']:<12} {r['hand_ms']:>9.3f} {r['trial_ms']:>9.3f} {r['ratio']:>7.3f} "
                  f"{r['ratio_iqr'][0]:>7.3f}-{r['ratio_iqr'][1]:.3f}")
    if args.json_path:
        write_file_atomic(args.json_path, json.dumps(
            {"machine": machine, "args": vars(args), "rows": rows, "trial_rows": trial_rows}, indent=2))


if __name__ == "__main__":
    main()
