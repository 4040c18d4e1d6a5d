"""``mpadvise probe --bench`` through the CLI runner, with a benchmark whose rows the test
chooses: a dtype the device could not run shows its reason, in the table and in --json."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import probes
from advisor.cli._app import app
from probes import BenchRow, HardwareProfile

runner = CliRunner()
NO_SCALED_MM = "torch 2.13.0 has no torch._scaled_mm"
OOM = "out of memory at size 8192; pass a smaller size"
# torch's CPU allocator error: square brackets that rich would read as markup.
NO_MEMORY = "fp16 matmul failed: [enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: not enough memory"


def _row(dtype: str, *, tflops: float | None, skipped: str | None = None) -> BenchRow:
    measured = tflops is not None
    return BenchRow(
        dtype=dtype,
        device="cpu",
        size=8192,
        tflops=tflops,
        seconds=2 * 8192**3 / tflops / 1e12 if measured else None,
        ratio_vs_fp32=tflops / 50.0 if measured else None,
        peak_tflops=None,
        fraction_of_peak=None,
        repeats=5,
        skipped=skipped,
        spread=0.01 if measured else None,
    )


def _bench(profile: HardwareProfile, **_) -> list[BenchRow]:
    return [
        _row("fp32", tflops=50.0),
        _row("fp16", tflops=None, skipped=NO_MEMORY),
        _row("bf16", tflops=None, skipped=OOM),
        _row("fp8", tflops=None, skipped=NO_SCALED_MM),
    ]


@pytest.fixture(autouse=True)
def skipping_benchmark(tmp_path, monkeypatch):
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(probes, "matmul_benchmark", _bench)


def test_the_table_shows_why_a_dtype_was_skipped():
    result = runner.invoke(app, ["probe", "--bench"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("matmul micro-benchmark"):]
    rows = {line.split()[1]: line for line in table.splitlines() if line.split()[1:2] in (["fp32"], ["fp16"], ["bf16"], ["fp8"])}
    assert "50.000" in rows["fp32"] and "1.00x" in rows["fp32"]
    assert "skipped" in rows["bf16"] and OOM in rows["bf16"]
    assert "skipped" in rows["fp16"] and NO_MEMORY in rows["fp16"]
    assert "skipped" in rows["fp8"] and NO_SCALED_MM in rows["fp8"]


def test_json_keeps_the_reason_and_no_figure():
    result = runner.invoke(app, ["probe", "--bench", "--json"])
    assert result.exit_code == 0, result.output
    bench = {row["dtype"]: row for row in json.loads(result.output)["devices"][-1]["bench"]}
    assert bench["fp32"]["tflops"] == 50.0 and bench["fp32"]["skipped"] is None
    assert bench["fp8"]["tflops"] is None and bench["fp8"]["skipped"] == NO_SCALED_MM
    assert bench["bf16"]["tflops"] is None and bench["bf16"]["skipped"] == OOM
