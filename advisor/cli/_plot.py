"""``mpadvise trial --plot``: one panel per candidate against fp32, as its verdict judged it,
then the step times. matplotlib is imported only when a plot is asked for."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor.tune import Basis, TrialCurve, basis, curve_of, smooth
from probes import MpadviseError, write_file_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from advisor.tune import Evaluation

_WIDTH = 11.0  # inches
_LEFT, _RIGHT = 0.8, 0.25  # margins, inches
_PANEL, _TICKS, _LINE, _GAP = 2.9, 0.55, 0.17, 0.3  # a loss panel, its axis labels, a text line, between rows
_TIMES = 2.0  # the step-time panel
_WRAP = 150  # characters per line of a reason
_REFERENCE_COLOR, _BAD, _GOOD = "black", "tab:red", "tab:green"


def plot_trials(path: str, reference: Evaluation, evaluations: list[Evaluation],
                **figure: Any) -> None:
    """Write ``trial_figure`` to ``path`` in the format its extension names (PNG without one)."""
    fig = trial_figure(reference, evaluations, **figure)
    image = io.BytesIO()
    try:
        fig.savefig(image, format=Path(path).suffix[1:].lower() or "png", dpi=110)
    except ValueError as exc:  # a format matplotlib does not know
        raise MpadviseError(f"cannot write plot {path}: {(str(exc) or type(exc).__name__).splitlines()[0]}") from None
    try:
        write_file_atomic(path, image.getvalue())
    except OSError as exc:
        raise MpadviseError(f"cannot write plot {path}: {exc.strerror or exc}") from None


def trial_figure(reference: Evaluation, evaluations: list[Evaluation], *, replicate: TrialCurve | None = None,
                 advice: Mapping[str, str] | None = None,
                 judged_against: Mapping[str, TrialCurve] | None = None) -> Figure:
    """The figure of a trial. Artists carry a ``gid`` naming what they show (``smoothed:<label>``,
    ``raw:<label>``, ``limit:final``, ``reason:<label>``...), so it can be read without the PNG;
    ``judged_against`` names, by label, a replicate other than ``replicate`` a verdict was given against."""
    figure_class = check_matplotlib()
    panels = evaluations or [reference]
    reasons = []  # under each panel: ``label (outcome): reason``, then its advice
    for ev in panels:
        note = (advice or {}).get(ev.label)
        text = f"{ev.label} ({ev.outcome}): {ev.reason or 'the fp32 reference'}"
        text += f". {note}" if note else ""
        reasons.append(textwrap.wrap(text, _WRAP) or [text])
    heights = [_PANEL + _TICKS + len(lines) * _LINE + _GAP for lines in reasons]
    top = 0.6
    total = top + sum(heights) + _TIMES + 1.0
    fig = figure_class(figsize=(_WIDTH, total))
    fig.suptitle("loss curves against fp32 (same seed and data order), as the verdicts judge them",
                 y=1 - 0.1 / total, fontsize=11)
    width = (_WIDTH - _LEFT - _RIGHT) / _WIDTH
    ref_curve = curve_of(reference.result, "fp32")
    y = total - top
    for ev, lines, height in zip(panels, reasons, heights, strict=True):
        ax = fig.add_axes((_LEFT / _WIDTH, (y - _PANEL) / total, width, _PANEL / total))
        against = (judged_against or {}).get(ev.label, replicate)
        _loss_panel(ax, ev, ref_curve, reference is ev, against)
        text_top = y - _PANEL - _TICKS
        color = _GOOD if ev.stable else _BAD
        fig.text(_LEFT / _WIDTH, text_top / total, "\n".join(lines), fontsize=8.5, va="top", ha="left",
                 color="black", gid=f"reason:{ev.label}",
                 bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": color})
        y -= height
    times = fig.add_axes((_LEFT / _WIDTH, 0.9 / total, width, _TIMES / total))
    _time_panel(times, reference, evaluations)
    return fig


def check_matplotlib() -> Any:
    """matplotlib's Figure, or one line saying how to install it (checked before the trials)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise MpadviseError('--plot needs matplotlib; install it with: pip install "mpadvise[plot]"') from None
    return Figure


def _loss_panel(ax: Axes, ev: Evaluation, ref_curve: TrialCurve, is_reference: bool,
                replicate: TrialCurve | None) -> None:
    """One candidate against fp32: raw and smoothed curves, limits, non-finite marks."""
    label = ev.label
    curve = curve_of(ev.result, ev.policy.mode) if ev.result.losses else TrialCurve(mode=ev.policy.mode, losses=())
    b = basis(curve, ref_curve, replicate=replicate)
    ref_steps = range(1, len(ref_curve.losses) + 1)
    # fp32 beneath: a thick dashed line with its own z-order, so a curve matching it cannot hide it.
    ax.plot(ref_steps, _finite(ref_curve.losses), color="gray", alpha=0.3, linewidth=0.8, zorder=1,
            gid=f"raw:fp32@{label}")
    ax.plot(ref_steps, _smoothed(ref_curve, b), color=_REFERENCE_COLOR,
            linestyle=(0, (5, 3)), linewidth=3.2, zorder=2, label="fp32 reference, smoothed", gid=f"smoothed:fp32@{label}")
    color = _GOOD if ev.stable else _BAD if not is_reference else _REFERENCE_COLOR
    if not is_reference and curve.losses:
        steps = range(1, len(curve.losses) + 1)
        ax.plot(steps, _finite(curve.losses), color=color, alpha=0.3, linewidth=0.8, zorder=3, gid=f"raw:{label}")
        ax.plot(steps, _smoothed(curve, b), color=color, linewidth=1.8,
                marker="o", markersize=2.5, markevery=max(1, len(curve.losses) // 25), zorder=4,
                label=f"{label}, smoothed ({b.window}-step median)", gid=f"smoothed:{label}")
        _limits(ax, ev, b)
        _nonfinite(ax, ev, curve, b)
    # A log axis when the losses span orders of magnitude (a loss floor far above fp32's end).
    finite = [v for v in [*ref_curve.losses, *curve.losses] if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 50:
        ax.set_yscale("log")
    title = "fp32 (reference)" if is_reference else f"{label}: {ev.outcome}"
    if ev.verdict is not None and not is_reference and not ev.stable:
        title += f" ({ev.verdict.kind.replace('_', ' ')})"
    ax.set_title(title, loc="left", fontsize=10, color=color, fontweight="bold")
    measured = _measured(ev, b)
    if measured and not is_reference:
        ax.set_title(measured, loc="right", fontsize=9, color=color)
    steps_judged = None if ev.verdict is None else ev.verdict.metrics.get("steps")
    if isinstance(steps_judged, int) and steps_judged != b.steps and not is_reference:
        ax.text(0.01, 0.03, f"judged over {steps_judged} steps against a longer fp32 run; drawn against this "
                f"fp32 run's {len(ref_curve.losses)}", transform=ax.transAxes, fontsize=7.5, color="dimgray")
    ax.set(xlabel="optimizer step", ylabel="loss")
    ax.grid(alpha=0.25)
    ax.margins(y=0.08)
    ax.legend(fontsize=7.5, loc="best", framealpha=0.85)


def _smoothed(curve: TrialCurve, b: Basis) -> list[float]:
    """The curve smoothed as the verdict smooths it (steps beyond the compared ones, which the
    verdict did not judge, alike), broken where no finite loss was recorded."""
    values = list(b.smoothed(curve.losses))
    if len(curve.losses) > b.steps:
        values += smooth(curve.losses, b.window)[b.steps:]
    return [s if math.isfinite(v) else math.nan for s, v in zip(values, curve.losses, strict=True)]


def _limits(ax: Axes, ev: Evaluation, b: Basis) -> None:
    """The limits the verdict applied, over the end window where its end level is taken."""
    if ev.verdict is None or not (math.isfinite(b.reference_end) and math.isfinite(b.reference_start)):
        return
    kind, metrics = ev.verdict.kind, ev.verdict.metrics
    climbed = kind == "diverged" and "first_nonfinite_step" not in metrics
    if kind not in ("ok", "stalled") and not climbed:
        return  # decided before any level was compared (a NaN, skips, the loss scale...)
    lo, hi = b.steps - b.window + 0.5, b.steps + 0.5
    ax.axvspan(lo, hi, color="gold", alpha=0.12, zorder=0, gid="window:end")
    progress = metrics.get("progress_ratio")
    progress_failed = kind == "stalled" and isinstance(progress, float) and progress < b.progress_limit
    gap_failed = kind == "stalled" and not progress_failed
    final_color = _BAD if gap_failed else _GOOD
    ax.fill_between([lo, hi], [b.reference_end] * 2, [b.final_level] * 2, color=final_color, alpha=0.35,
                    hatch="//" if gap_failed else None, zorder=1.5, gid="limit:final",
                    label=f"final-loss limit: up to fp32's end +{_pct(b.final_gap_limit)}")
    if not b.reference_flat:
        ax.hlines(b.progress_level, lo - b.window, hi, colors=_BAD if progress_failed else "tab:orange",
                  linestyles="dotted", linewidth=2.4, zorder=5, gid="limit:progress",
                  label=f"stall limit: end at or below, {_pct(b.progress_limit)} of fp32's fall")
    if (gap_failed or progress_failed) and math.isfinite(b.candidate_end):
        limit = b.final_level if gap_failed else b.progress_level
        ax.annotate("", xy=(b.steps, b.candidate_end), xytext=(b.steps, limit), zorder=6,
                    arrowprops={"arrowstyle": "->", "color": _BAD, "linewidth": 2})
    if climbed:
        ax.hlines(b.climb_level, lo - b.window, hi, colors=_BAD, linestyles="dashdot", linewidth=2.2, zorder=5,
                  gid="limit:climb", label=f"divergence limit: start +{_pct(b.climb_margin)}")


def _nonfinite(ax: Axes, ev: Evaluation, curve: TrialCurve, b: Basis) -> None:
    """A red x at the first NaN/inf loss the optimizer applied, with ``NaN at step N``."""
    step = ev.verdict.metrics.get("first_nonfinite_step") if ev.verdict is not None else None
    if not isinstance(step, int):
        step = b.first_nonfinite_step
    if step is None or step > len(curve.losses):
        return
    value = curve.losses[step - 1]
    word = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    before = [v for v in curve.losses[: step - 1] if math.isfinite(v)]
    y = before[-1] if before else b.reference_start
    if not math.isfinite(y):
        y = 0.0
    ax.axvline(step, color=_BAD, linestyle=":", linewidth=1.2, zorder=5)
    ax.plot([step], [y], marker="x", color=_BAD, markersize=14, markeredgewidth=3, linestyle="none", zorder=7,
            gid=f"nonfinite:{ev.label}", label=f"{word} at step {step}")
    ax.annotate(f"{word} at step {step}", (step, y), xytext=(14, -22), textcoords="offset points", color=_BAD,
                fontsize=10, fontweight="bold", zorder=7, gid=f"nonfinite-text:{ev.label}")


def _measured(ev: Evaluation, b: Basis) -> str:
    """The verdict's deciding numbers in a few words, for the panel's corner."""
    if ev.verdict is None:
        return ""
    m = ev.verdict.metrics
    parts = []
    if "progress_ratio" in m:
        parts.append(f"fell {_pct(m['progress_ratio'])} as far as fp32 (limit {_pct(b.progress_limit)})")
    if "final_gap" in m:
        gap = float(m["final_gap"])
        size = f"{gap + 1:.3g}x fp32's" if gap >= 1 else f"{gap:+.1%} vs fp32"
        parts.append(f"final loss {size} (limit +{_pct(b.final_gap_limit)})")
    if "candidate_rise" in m and ev.verdict.kind == "diverged":
        parts.append(f"rose {_pct(m['candidate_rise'])} from its start")
    return "; ".join(parts)


def _time_panel(ax: Axes, reference: Evaluation, evaluations: list[Evaluation]) -> None:
    timed = [ev for ev in [reference, *evaluations] if ev.timing is not None]
    medians = [ev.timing.median * 1e3 for ev in timed]  # type: ignore[union-attr]
    lower = [(ev.timing.median - ev.timing.q1) * 1e3 for ev in timed]  # type: ignore[union-attr]
    upper = [(ev.timing.q3 - ev.timing.median) * 1e3 for ev in timed]  # type: ignore[union-attr]
    colors = ["gray" if ev is reference else (_GOOD if ev.stable else _BAD) for ev in timed]
    ax.barh([ev.label for ev in timed], medians, xerr=[lower, upper], color=colors, capsize=4)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms), IQR whiskers")
    ax.set_title("step time (gray: fp32, green: stable, red: not)", loc="left", fontsize=10)
    ax.tick_params(axis="y", labelsize=8)


def _finite(values: Sequence[float]) -> list[float]:
    """Non-finite values as NaN: a gap in the line, marked separately."""
    return [v if math.isfinite(v) else math.nan for v in values]


def _pct(fraction: Any) -> str:
    value = float(fraction)
    return f"{value:.0%}" if abs(value) >= 0.1 else f"{value:.1%}"
