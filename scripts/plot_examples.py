"""Draw the example figures of ``mpadvise trial --plot`` in docs/plots/: a stall, a loss floor, a NaN.

Usage: python scripts/plot_examples.py [OUT_DIR]   (default docs/plots)

The trial results are constructed, not run: each loss curve is written here in the shape that
the failure it shows takes in a real trial (the verdict zoo in tests/verdicts/ has the scripts
that produce them), with the seeded noise of a batch-to-batch loss. Every verdict, limit and
reason in the figures then comes from the real verdict code (``advisor.tune._judge.evaluate``,
which calls ``_stability.judge``) and the figure from the real plot code
(``advisor.cli._plot.plot_trials``), so rerunning this after a change to either shows the
change. Step times are made up too (only the bottom panel shows them).

- stall.png: pure bf16 at a small learning rate (tests/verdicts/stall_bf16_small_lr.py):
  bf16-true falls a quarter as far as fp32, bf16-mixed keeps pace.
- floor.png: a regression heading to zero (tests/integration/scripts/regression_to_zero.py):
  fp32 reaches 1e-13, bf16-mixed stops at a floor near 1e-6.
- nan.png: pure fp16 with AdamW's eps=1e-8 (tests/verdicts/nan_fp16_adamw_eps.py): the loss is
  NaN from step 2; fp16-mixed trains as fp32 does.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

from advisor.cli._plot import plot_trials
from advisor.trial import TrialResult
from advisor.tune._judge import evaluate
from policies import Policy


def result(mode: str, losses: list[float], ms: float, *, eps: float | None = None) -> TrialResult:
    """A finished trial of ``mode`` that recorded ``losses`` at ``ms`` milliseconds a step."""
    steps = len(losses)
    return TrialResult(
        outcome="ok", label=mode, policy=Policy(mode=mode).to_dict(), losses=tuple(losses),
        step_times=tuple(ms / 1e3 * (1 + 0.05 * math.sin(i)) for i in range(steps)), samples=(64,) * steps,
        skipped=(False,) * steps, warmup_steps=3, user_batch=64, global_batch=64, peak_memory=300 * 2**20,
        workload_fingerprint="ab" * 8, model_signature="cd" * 8, optimizer_eps=eps,
    )


def noisy(values: list[float], seed: int, relative: float) -> list[float]:
    """``values`` with seeded batch-to-batch noise of ``relative`` of each value."""
    rng = random.Random(seed)
    return [v * (1 + relative * rng.uniform(-1, 1)) for v in values]


def stall() -> tuple[TrialResult, list[TrialResult]]:
    steps = 120
    fp32 = [0.72 + 0.5 * math.exp(-i / 45) for i in range(steps)]
    bf16_true = [0.72 + 0.5 * (0.78 + 0.22 * math.exp(-i / 25)) for i in range(steps)]
    return result("fp32", noisy(fp32, 0, 0.04), 10.0), [
        result("bf16-mixed", noisy(fp32, 1, 0.04), 7.0),
        result("bf16-true", noisy(bf16_true, 2, 0.04), 5.5),
    ]


def floor() -> tuple[TrialResult, list[TrialResult]]:
    steps = 320
    fp32 = [0.088 * 10 ** (-i / 27) for i in range(steps)]
    bf16 = [max(v, 6e-7) for v in fp32]
    return result("fp32", noisy(fp32, 0, 0.2), 10.0), [
        result("bf16-mixed", noisy(bf16, 1, 0.3), 8.0),
    ]


def nan() -> tuple[TrialResult, list[TrialResult]]:
    steps = 80
    fp32 = [0.24 + 1.09 * math.exp(-i / 18) for i in range(steps)]
    fp16_true = [1.529] + [math.nan] * (steps - 1)
    return result("fp32", noisy(fp32, 0, 0.05), 10.0), [
        result("fp16-mixed", noisy(fp32, 1, 0.05), 7.5, eps=1e-8),
        result("fp16-true", fp16_true, 6.0, eps=1e-8),
    ]


EXAMPLES = {"stall": stall, "floor": floor, "nan": nan}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, build in EXAMPLES.items():
        ref_result, results = build()
        reference = evaluate("fp32", Policy(mode="fp32"), ref_result, ref_result)
        evaluations = [evaluate(r.label, Policy(mode=r.label), r, ref_result) for r in results]
        path = out / f"{name}.png"
        plot_trials(str(path), reference, evaluations)
        print(f"{path}:")
        for ev in evaluations:
            print(f"  {ev.label}: {ev.outcome}: {ev.reason}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/plots"))
