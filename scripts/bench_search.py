"""The tuner against an exhaustive grid over the same space, per example script.

For each example: run every candidate of the space (the grid), then the tuner with its
defaults; re-measure both winners and the rule-of-thumb policy (bf16-mixed wherever bf16
exists, else fp16-mixed) interleaved in one run; report the regret
(1 - tuned goodput / grid-best goodput), the tuner's trials and wall time as a fraction of the
grid's, and the winner's speedup over fp32 and over the rule of thumb.

    .venv/bin/python scripts/bench_search.py [--examples mlp cnn tiny_lm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from advisor.tune._engine import measure_matmul, tune_policy
from advisor.tune._judge import evaluate
from advisor.tune._options import TuneOptions
from advisor.tune._run import ScriptRunner, TrialSettings
from advisor.tune._space import Candidate
from policies import Policy, supported_modes
from probes import primary_profile, write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "mlp": ("examples/mlp.py", ["--width", "128", "--epochs", "100"]),
    "cnn": ("examples/cnn.py", ["--channels", "8", "--epochs", "100", "--samples", "512"]),
    "tiny_lm": ("examples/tiny_lm.py", ["--width", "32", "--steps", "100000"]),
    # Wide enough that the matmuls dominate: on a CPU with AMX-BF16, bf16 wins here.
    "mlp_wide": ("examples/mlp.py", ["--width", "2048", "--batch-size", "256", "--epochs", "100"]),
    "tiny_lm_wide": ("examples/tiny_lm.py", ["--width", "512", "--steps", "100000"]),
}


def rule_of_thumb(profile) -> str:
    support = supported_modes(profile)
    return "bf16-mixed" if support["bf16-mixed"].supported else "fp16-mixed"


def remeasure(runner, policies: dict[str, Policy], rounds: int) -> dict[str, float]:
    """Median goodput of each policy over ``rounds`` runs, alternating the order each round."""
    names = list(policies)
    goodputs: dict[str, list[float]] = {n: [] for n in names}
    ref = runner(Policy(mode="fp32"), "fp32")
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            result = runner(policies[name], name)
            ev = evaluate(name, policies[name], result, ref)
            if ev.goodput:
                goodputs[name].append(ev.goodput)
    return {n: statistics.median(v) if v else 0.0 for n, v in goodputs.items()}


def bench(name: str, *, steps: int, warmup: int, rounds: int) -> dict:
    script, args = EXAMPLES[name]
    profile = primary_profile()
    ratios, _ = measure_matmul(profile)  # same priors for both runs
    runner = ScriptRunner(ROOT / script, args, TrialSettings(warmup_steps=warmup, measure_steps=steps))

    t0 = time.perf_counter()
    grid = tune_policy(runner, profile, TuneOptions(trials=10_000, no_priors=True), remeasure=False, dtype_ratio=ratios)
    grid_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    tuned = tune_policy(runner, profile, TuneOptions(), dtype_ratio=ratios)
    tuned_wall = time.perf_counter() - t0
    # The sampler alone, without the priors, on a quarter of the grid's trials.
    quarter = max(2, len(grid.space.grid()) // 4)
    t0 = time.perf_counter()
    blind = tune_policy(runner, profile, TuneOptions(trials=quarter - 1, no_priors=True), dtype_ratio=ratios)
    blind_wall = time.perf_counter() - t0

    user_batch = grid.space.user_batch
    thumb = Candidate(rule_of_thumb(profile))
    contenders = {
        "grid winner": grid.winner.policy(user_batch) if grid.winner else Policy(mode="fp32"),
        "tuned winner": tuned.winner.policy(user_batch) if tuned.winner else Policy(mode="fp32"),
        "tuned winner, no priors": blind.winner.policy(user_batch) if blind.winner else Policy(mode="fp32"),
        "rule of thumb": thumb.policy(user_batch),
        "fp32": Policy(mode="fp32"),
    }
    good = remeasure(runner, contenders, rounds)
    return {
        "example": name,
        "grid_winner": grid.winner.label if grid.winner else None,
        "tuned_winner": tuned.winner.label if tuned.winner else None,
        "grid_candidates": len(grid.space.grid()),
        "grid_trials": grid.search.runs + 1,  # + the reference
        "tuned_trials": tuned.search.runs + 1 + sum(len(f.goodputs) - 1 for f in tuned.finalists),
        "grid_wall_s": grid_wall,
        "tuned_wall_s": tuned_wall,
        "cost_trials": (tuned.search.runs + 1) / (grid.search.runs + 1),
        "cost_wall": tuned_wall / grid_wall,
        # The same policy measured twice differs only by noise: its regret is 0 by definition,
        # and the measured difference is reported as the noise floor.
        "regret": 0.0 if contenders["tuned winner"] == contenders["grid winner"]
        else (1 - good["tuned winner"] / good["grid winner"] if good["grid winner"] else None),
        "same_policy_noise": 1 - good["tuned winner"] / good["grid winner"]
        if contenders["tuned winner"] == contenders["grid winner"] and good["grid winner"] else None,
        "no_priors_winner": blind.winner.label if blind.winner else None,
        "no_priors_trials": blind.search.runs + 1,
        "no_priors_wall_s": blind_wall,
        "no_priors_regret": 0.0 if contenders["tuned winner, no priors"] == contenders["grid winner"]
        else (1 - good["tuned winner, no priors"] / good["grid winner"] if good["grid winner"] else None),
        "speedup_vs_fp32": good["tuned winner"] / good["fp32"] if good["fp32"] else None,
        "speedup_vs_rule_of_thumb": good["tuned winner"] / good["rule of thumb"] if good["rule of thumb"] else None,
        "rule_of_thumb": thumb.label,
        "goodput": good,
        "tuned_stop_reason": tuned.search.stop_reason,
        "matmul_ratio_vs_fp32": ratios,
        "args": [script, *args],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved re-measure rounds")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    profile = primary_profile()
    rows = [bench(e, steps=args.steps, warmup=args.warmup, rounds=args.rounds) for e in args.examples]
    print(f"machine: {profile.name} ({profile.kind}), torch {profile.torch_version}")
    print(f"{'example':<9} {'grid winner':<26} {'tuned winner':<26} {'regret':>7} {'trials':>9} {'wall':>6} "
          f"{'vs fp32':>8} {'vs thumb':>9}")
    for r in rows:
        print(f"{r['example']:<9} {str(r['grid_winner']):<26} {str(r['tuned_winner']):<26} {r['regret']:>7.1%} "
              f"{r['tuned_trials']:>3}/{r['grid_trials']:<5} {r['cost_wall']:>6.0%} {r['speedup_vs_fp32']:>7.2f}x "
              f"{r['speedup_vs_rule_of_thumb']:>8.2f}x")
    print("without the priors (the sampler alone, a quarter of the grid's trials):")
    for r in rows:
        print(f"{r['example']:<9} {str(r['no_priors_winner']):<26} regret {r['no_priors_regret']:.1%}, "
              f"{r['no_priors_trials']}/{r['grid_trials']} trials, {r['no_priors_wall_s'] / r['grid_wall_s']:.0%} of the wall time")
    if args.json_path:
        write_file_atomic(args.json_path, json.dumps({"machine": profile.to_dict(), "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
