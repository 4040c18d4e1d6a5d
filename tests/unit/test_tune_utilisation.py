"""Achieved TFLOP/s and MFU per candidate: the reference counts its FLOPs once, every candidate
is held to the probed matmul peak of the dtype it computes in, in the table, the JSON and the
cache rows."""

from __future__ import annotations

import dataclasses
import functools
import io

import pytest
from rich.console import Console
from test_search import FakeRunner, tune
from test_search_remeasure import MODES

import probes
from advisor.cli._report import render_tune
from advisor.trial import TrialResult
from advisor.tune._answer import compute_dtype, utilisation
from advisor.tune._engine import TuneCost
from advisor.tune._service import cache_rows
from probes import BenchRow

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

PEAKS = {"fp32": 2.0, "tf32": 8.0, "bf16": 16.0, "fp16": 16.0, "fp8": 32.0}
FLOPS = 3.0e12  # per optimizer step


@pytest.mark.parametrize(("mode", "dtype"), [
    ("fp32", "fp32"), ("tf32", "tf32"), ("bf16-mixed", "bf16"), ("fp16-mixed", "fp16"), ("bf16-true", "bf16"),
    ("fp16-true", "fp16"), ("fp8-torchao", "fp8"), ("fp8-te", "fp8"),
])
def test_each_mode_is_held_to_the_peak_of_the_dtype_its_matmuls_run_in(mode, dtype):
    assert compute_dtype(mode) == dtype


def test_achieved_tflops_is_the_step_count_over_the_median_step_and_mfu_its_share_of_the_peak():
    found = utilisation(FLOPS, 0.5, "bf16-mixed", PEAKS)
    assert found.tflops == pytest.approx(6.0) and found.dtype == "bf16"
    assert found.peak_tflops == 16.0 and found.mfu == pytest.approx(6.0 / 16.0)
    # a dtype the benchmark did not measure (fp8 emulated on a CPU) has TFLOP/s but no MFU
    cpu = utilisation(FLOPS, 0.5, "fp8-torchao", {"fp32": 0.1, "bf16": 0.002})
    assert cpu.tflops == pytest.approx(6.0) and cpu.peak_tflops is None and cpu.mfu is None
    # bf16 with no fast path (AVX2 only: the probe measured it at 1% of fp32): held to fp32's rate,
    # where the slow path's own rate would call a slow run more than 100% efficient
    avx2 = utilisation(FLOPS, 0.5, "bf16-mixed", {"fp32": 100.0, "bf16": 1.0})
    assert avx2.dtype == "fp32" and avx2.peak_tflops == 100.0 and avx2.mfu == pytest.approx(0.06)
    assert utilisation(None, 0.5, "fp32", PEAKS) is None and utilisation(FLOPS, 0.0, "fp32", PEAKS) is None


class CountingRunner(FakeRunner):
    """A fake runner that counts FLOPs in the trials of a runner derived ``with_flop_count``."""

    def __init__(self, step_ms, *, counting=False, log=None):
        super().__init__(step_ms)
        self.counting = counting
        self.log = [] if log is None else log

    def with_flop_count(self, on=True):
        derived = CountingRunner(self.step_ms, counting=on, log=self.log)
        derived.calls, derived.labels = self.calls, self.labels
        return derived

    def __call__(self, policy, label):
        result = super().__call__(policy, label)
        self.log.append((label, self.counting))
        if not self.counting:
            return result
        return dataclasses.replace(result, flops_per_step=FLOPS, flops_basis="counted")


def test_the_reference_alone_counts_and_every_candidate_shows_its_tflops_and_mfu():
    runner = CountingRunner({"fp32": 1000, "bf16-mixed": 400, "bf16-true": 300})
    result = tune(runner, modes=MODES, remeasure=True, dtype_ratio={"fp32": 1.0, "bf16": 4.0},
                  peak_tflops=PEAKS)
    assert [label for label, counted in runner.log if counted] == ["fp32"]
    data = result.to_dict()
    assert data["flops_per_step"] == FLOPS and data["flops_basis"] == "counted" and data["peak_tflops"] == PEAKS
    rows = {row["label"]: row for row in data["candidates"]}
    assert rows["fp32"]["tflops"] == pytest.approx(3.0) and rows["fp32"]["mfu"] == pytest.approx(1.5)
    assert rows["bf16-true"]["tflops"] == pytest.approx(10.0) and rows["bf16-true"]["mfu_dtype"] == "bf16"
    assert rows["bf16-true"]["mfu"] == pytest.approx(10.0 / 16.0)
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(data, console)
    text = console.export_text()
    # Every row's MFU is of one stated peak, the fastest dtype's (bf16, 16 TFLOP/s): fp32's 3
    # TFLOP/s is 19% of it, not 150% of fp32's own peak.
    assert "TFLOP/s" in text and "MFU" in text and " 62% " in text and " 19% " in text and " 150% " not in text
    assert "the probed bf16 matmul peak (16 TFLOP/s, the fastest dtype's)" in text
    narrow = Console(record=True, width=80, file=io.StringIO())
    render_verbose(data, narrow)
    table = narrow.export_text().split("FLOPs per step")[0]
    assert "…" not in table and " 62% " in table  # at 80 columns headers fold, numbers stay whole
    assert "FLOPs per step 3e+12 (counted, in the fp32 reference)" in text
    cached = {row["metrics"]["label"]: row["metrics"] for row in cache_rows(result)}
    assert cached["bf16-true"]["tflops"] == pytest.approx(10.0) and cached["bf16-true"]["mfu"] == pytest.approx(0.625)


def _bench_rows(tflops: dict[str, float]) -> list[BenchRow]:
    return [BenchRow(dtype=d, device="cuda:0", size=8192, tflops=t, seconds=1.0, ratio_vs_fp32=t / tflops["fp32"],
                     peak_tflops=None, fraction_of_peak=None, repeats=5) for d, t in tflops.items()]


def test_the_peaks_are_probed_at_both_ends_of_the_tune_and_each_dtype_keeps_its_higher(monkeypatch):
    # A neighbour's burst slowed fp32's matmuls in the first probe and bf16's in the second: a
    # peak is what the hardware can do, so each dtype keeps its better probe, and no MFU rests
    # on one disturbed reading.
    probes_run = iter([{"fp32": 1.0, "bf16": 16.0}, {"fp32": 2.0, "bf16": 4.0}])
    monkeypatch.setattr(probes, "matmul_benchmark", lambda profile: _bench_rows(next(probes_run)))
    runner = CountingRunner({"fp32": 1000, "bf16-mixed": 400, "bf16-true": 300})
    result = tune(runner, modes=MODES, remeasure=True, dtype_ratio=None)
    assert result.peak_tflops == {"fp32": 2.0, "bf16": 16.0}
    assert result.dtype_ratio["bf16"] == 16.0  # the search's priors are the first probe's, as it started
    rows = {row["label"]: row for row in result.to_dict()["candidates"]}
    assert rows["fp32"]["mfu"] == pytest.approx(3.0 / 2.0) and rows["bf16-true"]["mfu"] == pytest.approx(10.0 / 16.0)


def test_without_a_flop_count_the_peaks_are_probed_once(monkeypatch):
    calls = []
    monkeypatch.setattr(probes, "matmul_benchmark", lambda profile: calls.append(1) or _bench_rows({"fp32": 1.0}))
    tune(FakeRunner({"fp32": 1000, "bf16-mixed": 400, "bf16-true": 300}), modes=MODES, remeasure=False,
         dtype_ratio=None)
    assert len(calls) == 1  # for the search's priors only: no MFU to compute


def test_without_a_count_the_columns_say_unknown_rather_than_zero():
    result = tune(FakeRunner({"fp32": 1000, "bf16-mixed": 400, "bf16-true": 300}), modes=MODES, remeasure=False,
                  dtype_ratio={"fp32": 1.0, "bf16": 4.0}, peak_tflops=PEAKS)
    data = result.to_dict()
    assert all(row["tflops"] is None and row["mfu"] is None for row in data["candidates"])
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose(data, console)
    assert "TFLOP/s and MFU: not known" in console.export_text()


def test_the_tune_reports_its_cost_in_measured_windows():
    def trial(launched, first_step, warmup_done, measured_done, wall):
        timeline = {"launched": launched, "first_step": first_step, "warmup_done": warmup_done,
                    "measured_done": measured_done, "exited": launched + wall}
        return TrialResult(outcome="ok", timeline=timeline, wall_s=wall)

    ran = [trial(0.0, 1.5, 1.6, 2.1, 2.2), trial(10.0, 10.5, 10.6, 11.1, 1.2), trial(20.0, 20.4, 20.5, 21.0, 1.1)]
    cost = TuneCost.of(ran, 50.0, ran[0])
    assert TuneCost.of(ran, 50.0, trial(0.0, 1.5, 1.6, 3.6, 4.0)).window_s == pytest.approx(2.0)  # the kept reference's
    assert cost.trials == 3 and cost.window_s == pytest.approx(0.5) and cost.trial_equivalents == 100.0
    console = Console(record=True, width=200, file=io.StringIO())
    render_verbose({"cost": cost.to_dict(), "candidates": [], "winner": None}, console)
    text = console.export_text()
    assert "cost: 3 trials in 50 s, 100 measured windows of 0.5 s" in text and "start-up took" not in text
