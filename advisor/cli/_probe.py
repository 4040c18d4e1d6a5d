"""How ``mpadvise probe`` shows ``advisor._hardware.probe_report`` as tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def render_probe(report: dict[str, Any], console: Console) -> None:
    for device in report["devices"]:
        p = device["profile"]
        primary = " (training device)" if device["fingerprint"] == report["primary"] else ""
        title = f"{p['name']}{primary}"
        facts = Table(title=title, show_header=False, title_justify="left", title_style="bold")
        facts.add_column(style="cyan")
        facts.add_column()
        facts.add_row("kind", p["kind"] + (f" (cuda:{p['index']})" if p["kind"] == "cuda" else ""))
        facts.add_row("capability", device["capability"])
        if p["kind"] == "cuda":
            facts.add_row("compute capability", ".".join(map(str, p["compute_capability"] or [])))
            facts.add_row("SMs", str(p["sm_count"]))
            facts.add_row("memory", f"{_gib(p['memory_total'])} total, {_gib(p['memory_free'])} free")
            facts.add_row("driver / CUDA", f"{p['driver_version'] or '-'} / {p['cuda_runtime'] or '-'}")
            facts.add_row("MIG", {True: "on", False: "off", None: "unknown"}[p["mig_enabled"]])
            if device["peak_tflops"]:
                peaks = ", ".join(f"{k} {v:g}" for k, v in device["peak_tflops"].items())
                facts.add_row("datasheet peak TFLOP/s", peaks)
        else:
            facts.add_row("cores", str(p["cores"]))
            facts.add_row("memory", _gib(p["memory_total"]))
            facts.add_row("precision ISA flags", ", ".join(p["cpu_flags"]) or "none")
        facts.add_row("torch", str(p["torch_version"]))
        libs = ", ".join(f"{k} {v or 'not installed'}" for k, v in p["libraries"].items())
        facts.add_row("FP8 libraries", libs or "-")
        facts.add_row("fingerprint", device["fingerprint"])
        facts.add_row("safe default", f"[bold]{device['safe_default']['mode']}[/]: {device['safe_default']['reason']}")
        console.print(facts)

        modes = Table(title_justify="left")
        modes.add_column("mode")
        modes.add_column("supported")
        modes.add_column("why")
        for name, info in device["modes"].items():
            mark = "[yellow]emulated[/]" if info["emulated"] else ("[green]yes[/]" if info["supported"] else "[red]no[/]")
            modes.add_row(name, mark, info["reason"])
        console.print(modes)

        if "bench" in device:
            console.print(_bench_table(device["bench"]))


def _bench_table(rows: list[dict[str, Any]]) -> Table:
    """The matmul benchmark's rows; a dtype that was not measured shows why, not a figure."""
    table = Table(title="matmul micro-benchmark", title_justify="left")
    for col in ("dtype", "size", "TFLOP/s", "vs fp32", "of peak"):
        table.add_column(col, justify="right" if col != "dtype" else "left")
    # A dtype is skipped for fp8 without torch._scaled_mm, an OOM at the default size, or a
    # kernel this build lacks; its row has no figures, only the reason.
    if any(row.get("tflops") is None for row in rows):
        table.add_column("note")
    for row in rows:
        if row.get("tflops") is None:
            reason = escape(row.get("skipped") or "not measured")
            table.add_row(row["dtype"], str(row["size"]), "-", "-", "-", f"[yellow]skipped[/]: {reason}")
            continue
        ratio, frac = row.get("ratio_vs_fp32"), row.get("fraction_of_peak")
        table.add_row(
            row["dtype"],
            str(row["size"]),
            f"{row['tflops']:.3f}",
            f"{ratio:.2f}x" if ratio else "-",
            f"{frac:.0%}" if frac else "-",
        )
    return table
