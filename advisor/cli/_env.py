"""The machine's commands: ``mpadvise env``, a block to paste into a bug report (secrets
masked), and ``mpadvise probe``'s tables of ``advisor._hardware.probe_report``."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from advisor.cli._common import JsonOption, emit, handle_errors
from advisor.tune import shown_url

# The distributions whose versions change what mpadvise can do, each with the names it ships
# under (Transformer Engine's wheels have been published under several).
OPTIONAL_PACKAGES: dict[str, tuple[str, ...]] = {
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "torchao": ("torchao",),
    "lightning": ("lightning", "pytorch-lightning"),
    "transformers": ("transformers",),
    "accelerate": ("accelerate",),
    "optuna": ("optuna",),
}

# The CPU flags that make bf16 and fp16 native (see probes' PRECISION_FLAGS), by the name a
# reader knows them by.
_CPU_FLAG_NAMES = {"amx_bf16": "AMX-BF16", "amx_fp16": "AMX-FP16", "amx_tile": "AMX-TILE",
                   "avx512_bf16": "AVX512-BF16", "avx512_fp16": "AVX512-FP16", "avx512f": "AVX512F", "avx2": "AVX2"}

_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
_SECRET_QUERY = ("password", "passwd", "token", "secret", "key", "auth", "sslpassword")
MASK = "****"


@handle_errors
def probe(
    json_output: JsonOption = False,
    bench: Annotated[bool, typer.Option("--bench", help="Also measure matmul TFLOP/s per dtype on each device.")] = False,
) -> None:
    """Show what this machine can do: devices, supported precision modes, the safe default."""
    from advisor._hardware import probe_report

    emit(probe_report(bench=bench), json_output, render_probe)


@handle_errors
def env(json_output: JsonOption = False) -> None:
    """Versions, hardware and settings to paste into a bug report (secrets masked)."""
    emit(env_report(), json_output, render_env)


def mask_secret(name: str, value: str) -> str:
    """``value`` of variable ``name`` as a public bug report may show it: whole for a name that
    says secret (``..._TOKEN``), a URL's password and secret-looking query parameters masked."""
    if any(word in name.upper() for word in _SECRET_WORDS):
        return MASK if value else value
    if "://" not in value:
        return value
    # The password as every report masks it (one holding "/" or "@" included), then any other
    # secret-looking query parameter.
    shown = shown_url(value) or value
    query = shown.partition("?")[2]
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_QUERY for k, _ in pairs):
        masked = urlencode([(k, MASK if k.lower() in _SECRET_QUERY else v) for k, v in pairs], safe="*")
        shown = shown.replace("?" + query, "?" + masked, 1)
    return shown


def env_report(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    import probes
    from advisor._paths import database_path
    from advisor._version import __version__
    from policies import capability_summary

    environ = os.environ if environ is None else environ
    cpu = probes.cpu_profile()
    try:
        capability = capability_summary(probes.primary_profile())
    except Exception as exc:  # noqa: BLE001 - a report for a bug report must not itself fail
        capability = f"unknown ({type(exc).__name__}: {exc})"
    return {
        "mpadvise": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "torch": _torch(),
        "packages": {name: probes.first_installed(dists) for name, dists in OPTIONAL_PACKAGES.items()},
        "os": platform.platform(),
        "cpu": {"model": cpu.name, "cores": cpu.cores, "flags": list(cpu.cpu_flags),
                "native_bf16": any(f in cpu.cpu_flags for f in ("amx_bf16", "avx512_bf16"))},
        "gpus": _gpus(),
        "capability": capability,
        "cache": str(database_path()),
        "environment": {name: mask_secret(name, value) for name, value in sorted(environ.items())
                        if name.startswith("MPADVISE_")},
    }


def render_env(report: dict[str, Any], console: Console) -> None:
    """Print the report as a Markdown list to paste into a bug report, one fact per line,
    never wrapped (a wrapped line pasted into an issue reads as two facts)."""
    torch = report["torch"]
    torch_line = "not installed" if torch is None else f"{torch['version']} ({torch['build']})"
    cpu = report["cpu"]
    flags = ", ".join(_CPU_FLAG_NAMES.get(flag, flag) for flag in cpu["flags"]) or "none that matter"
    lines = [
        "Copy and paste the text below into a bug report.",
        "",
        f"- mpadvise: {report['mpadvise']}",
        f"- Python: {report['python']}",
        f"- torch: {torch_line}",
        *(f"- {name}: {version or 'not installed'}" for name, version in report["packages"].items()),
        f"- OS: {report['os']}",
        f"- CPU: {cpu['model']} ({cpu['cores'] or '?'} usable cores); flags: {flags}",
    ]
    lines += [f"- GPU {gpu['index']}: {gpu['name']}, compute capability "
              f"{gpu['compute_capability'] or '?'}, {gpu['memory']}, "
              f"driver {gpu['driver'] or '?'}, CUDA {gpu['cuda_runtime'] or '?'}"
              + (", MIG on" if gpu.get("mig") else "")
              for gpu in report["gpus"]] or ["- GPUs: none visible"]
    environment = ", ".join(f"{name}={value}" for name, value in report["environment"].items())
    lines += [f"- capability: {report['capability']}", f"- cache: {report['cache']}",
              f"- environment: {environment or 'no MPADVISE_* variables set'}"]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _torch() -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        return None
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    if cuda:
        try:
            cudnn = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001 - a broken cuDNN is itself worth reporting, not a crash
            cudnn = None
        build = f"CUDA {cuda}" + (f", cuDNN {cudnn}" if cudnn else "")
    elif hip:
        build = f"ROCm {hip}"
    else:
        build = "CPU build"
    try:
        usable = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        usable = False
    build += ", CUDA usable" if usable else (", CUDA not usable here" if cuda else "")
    return {"version": torch.__version__, "cuda": cuda, "hip": hip, "cuda_available": usable, "build": build}


def _gpus() -> list[dict[str, Any]]:
    """Every GPU the probes see; none where there is no driver, NVML or CUDA."""
    import probes

    try:
        profiles = probes.cuda_profiles()
    except Exception:  # noqa: BLE001 - the probes already degrade; this is the last guard
        return []
    return [{"index": p.index, "name": p.name,
             "compute_capability": ".".join(map(str, p.compute_capability or ())) or None,
             "memory": _gib(p.memory_total), "driver": p.driver_version, "cuda_runtime": p.cuda_runtime,
             "mig": p.mig_enabled} for p in profiles]


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def render_probe(report: dict[str, Any], console: Console) -> None:
    for device in report["devices"]:
        p = device["profile"]
        cuda = p["kind"] == "cuda"
        facts = [("kind", p["kind"] + (f" (cuda:{p['index']})" if cuda else "")),
                 ("capability", device["capability"])]
        if cuda:
            peaks = ", ".join(f"{k} {v:g}" for k, v in (device["peak_tflops"] or {}).items())
            facts += [("compute capability", ".".join(map(str, p["compute_capability"] or []))),
                      ("SMs", str(p["sm_count"])),
                      ("memory", f"{_gib(p['memory_total'])} total, {_gib(p['memory_free'])} free"),
                      ("driver / CUDA",
                       f"{p['driver_version'] or '-'} / {p['cuda_runtime'] or '-'}"),
                      ("MIG", {True: "on", False: "off", None: "unknown"}[p["mig_enabled"]]),
                      *([("datasheet peak TFLOP/s", peaks)] if peaks else [])]
        else:
            facts += [("cores", str(p["cores"])), ("memory", _gib(p["memory_total"])),
                      ("precision ISA flags", ", ".join(p["cpu_flags"]) or "none")]
        libs = ", ".join(f"{k} {v or 'not installed'}" for k, v in p["libraries"].items())
        safe = device["safe_default"]
        facts += [("torch", str(p["torch_version"])), ("FP8 libraries", libs or "-"),
                  ("fingerprint", device["fingerprint"]),
                  ("safe default", f"[bold]{safe['mode']}[/]: {safe['reason']}")]
        primary = " (training device)" if device["fingerprint"] == report["primary"] else ""
        table = Table(title=f"{p['name']}{primary}", show_header=False, title_justify="left",
                      title_style="bold")
        table.add_column(style="cyan")
        table.add_column()
        for fact in facts:
            table.add_row(*fact)
        console.print(table)

        modes = Table("mode", "supported", "why", title_justify="left")
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
    # A dtype skipped (fp8 without torch._scaled_mm, an OOM, a missing kernel) shows only why.
    if any(row.get("tflops") is None for row in rows):
        table.add_column("note")
    for row in rows:
        if row.get("tflops") is None:
            reason = escape(row.get("skipped") or "not measured")
            table.add_row(row["dtype"], str(row["size"]), "-", "-", "-", f"[yellow]skipped[/]: {reason}")
            continue
        ratio, frac = row.get("ratio_vs_fp32"), row.get("fraction_of_peak")
        table.add_row(row["dtype"], str(row["size"]), f"{row['tflops']:.3f}",
                      f"{ratio:.2f}x" if ratio else "-", f"{frac:.0%}" if frac else "-")
    return table
