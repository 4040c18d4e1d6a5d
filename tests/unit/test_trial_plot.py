"""`mpadvise trial --plot` shows why each verdict is what it is: the smoothed curves the verdict
judged, fp32 beneath them, a red x where a loss went NaN, the limit the verdict applied, and the
verdict's reason in words. The results are constructed; every verdict comes from the real
verdict code (``evaluate`` calls ``judge``), and the figure is read through its artists."""

from __future__ import annotations

import math
import random

import pytest

import advisor.cli._plot as plot_module
import advisor.cli._trial as trial_cli
from advisor._log import get_logger
from advisor.cli._plot import plot_trials, trial_figure
from advisor.trial import TrialResult
from advisor.tune._judge import curve_of, evaluate
from advisor.tune._stability import basis, smooth
from policies import Policy
from probes import MpadviseError

pytest.importorskip("matplotlib")


def _result(mode: str, losses: list[float]) -> TrialResult:
    steps = len(losses)
    return TrialResult(
        outcome="ok", label=mode, policy=Policy(mode=mode).to_dict(), losses=tuple(losses),
        step_times=(0.01,) * steps, samples=(64,) * steps, skipped=(False,) * steps, warmup_steps=3,
        user_batch=64, global_batch=64, peak_memory=2**20, workload_fingerprint="ab" * 8, model_signature="cd" * 8,
    )


def _noisy(values: list[float], seed: int, relative: float = 0.03) -> list[float]:
    rng = random.Random(seed)
    return [v * (1 + relative * rng.uniform(-1, 1)) for v in values]


def _judged(ref: list[float], candidates: dict[str, list[float]]):
    ref_result = _result("fp32", ref)
    reference = evaluate("fp32", Policy(mode="fp32"), ref_result, ref_result)
    evaluations = [evaluate(mode, Policy(mode=mode), _result(mode, losses), ref_result)
                   for mode, losses in candidates.items()]
    return reference, evaluations


def _stall():
    steps = 100
    fp32 = [0.7 + 0.5 * math.exp(-i / 40) for i in range(steps)]
    stalled = [0.7 + 0.5 * (0.8 + 0.2 * math.exp(-i / 25)) for i in range(steps)]
    return _judged(_noisy(fp32, 0), {"bf16-mixed": _noisy(fp32, 1), "bf16-true": _noisy(stalled, 2)})


def _floor():
    fp32 = [0.09 * 10 ** (-i / 25) for i in range(300)]
    return _judged(_noisy(fp32, 0, 0.2), {"bf16-mixed": _noisy([max(v, 1e-6) for v in fp32], 1, 0.2)})


def _nan():
    fp32 = [0.25 + 1.0 * math.exp(-i / 15) for i in range(60)]
    return _judged(_noisy(fp32, 0), {"fp16-mixed": _noisy(fp32, 1), "fp16-true": [1.5] + [math.nan] * 59})


def _by_gid(fig, prefix: str) -> list:
    return [a for a in fig.findobj() if (a.get_gid() or "").startswith(prefix)]


def _texts(fig) -> str:
    return "\n".join(t.get_text() for t in fig.texts).replace("\n", " ")


def _reason_shown(fig, ev) -> bool:
    words = " ".join(_texts(fig).split())
    return " ".join(ev.reason.split()) in words


@pytest.mark.parametrize("case, kind", [(_stall, "stalled"), (_floor, "stalled"), (_nan, "diverged")])
def test_every_mode_has_its_smoothed_curve_and_every_reason_is_in_the_figure(case, kind):
    reference, evaluations = case()
    assert evaluations[-1].verdict.kind == kind and not evaluations[-1].stable
    fig = trial_figure(reference, evaluations)
    for ev in evaluations:
        (line,) = _by_gid(fig, f"smoothed:{ev.label}")
        b = basis(curve_of(ev.result, ev.policy.mode), curve_of(reference.result, "fp32"))
        expected = smooth(ev.result.losses, b.window)
        drawn = list(line.get_ydata())
        # The verdict's own smoothing, broken only where no finite loss was recorded.
        assert all(math.isnan(d) if not math.isfinite(raw) else d == pytest.approx(e)
                   for d, e, raw in zip(drawn, expected, ev.result.losses, strict=True))
        assert _by_gid(fig, f"raw:{ev.label}")
        (fp32,) = _by_gid(fig, f"smoothed:fp32@{ev.label}")
        # fp32 drawn beneath, thicker and dashed: a matching curve cannot hide it.
        assert fp32.get_linewidth() > line.get_linewidth() and fp32.get_zorder() < line.get_zorder()
        assert fp32.get_linestyle() != "-"
        assert _reason_shown(fig, ev), ev.reason


def test_a_stall_shows_the_progress_limit_it_missed():
    reference, evaluations = _stall()
    stalled = evaluations[-1]
    assert "progress_ratio" in stalled.verdict.metrics
    fig = trial_figure(reference, evaluations)
    limits = _by_gid(fig, "limit:progress")
    assert len(limits) == 2  # one per candidate panel
    b = basis(curve_of(stalled.result, "bf16-true"), curve_of(reference.result, "fp32"))
    (segment,) = limits[-1].get_segments()
    assert segment[0][1] == pytest.approx(b.progress_level)
    # The stalled curve ends above the level it had to reach; the verdict says so too.
    assert b.candidate_end > b.progress_level
    assert stalled.verdict.metrics["progress_ratio"] < b.progress_limit


def test_a_loss_floor_shows_the_final_loss_band_far_below_the_candidate():
    reference, evaluations = _floor()
    (floor,) = evaluations
    fig = trial_figure(reference, evaluations)
    (band,) = _by_gid(fig, "limit:final")
    b = basis(curve_of(floor.result, "bf16-mixed"), curve_of(reference.result, "fp32"))
    top = band.get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(b.final_level)
    assert b.candidate_end > 100 * top
    assert floor.verdict.metrics["final_gap"] > b.final_gap_limit
    assert (band.axes.get_yscale()) == "log"  # a floor a million times above fp32's end stays visible


def test_a_nan_is_marked_at_its_step_with_its_label():
    reference, evaluations = _nan()
    fig = trial_figure(reference, evaluations)
    (mark,) = _by_gid(fig, "nonfinite:")
    assert mark.get_gid() == "nonfinite:fp16-true"
    assert list(mark.get_xdata()) == [2] and mark.get_marker() == "x"
    (label,) = _by_gid(fig, "nonfinite-text:fp16-true")
    assert label.get_text() == "NaN at step 2"
    assert evaluations[-1].verdict.metrics["first_nonfinite_step"] == 2
    assert not _by_gid(fig, "nonfinite:fp16-mixed")


def test_the_basis_is_the_verdicts_own_measurement():
    reference, evaluations = _stall()
    for ev in evaluations:
        b = basis(curve_of(ev.result, ev.policy.mode), curve_of(reference.result, "fp32"))
        m = ev.verdict.metrics
        assert (b.steps, b.window) == (m["steps"], m["smoothing_window"])
        assert (b.candidate_start, b.candidate_end) == (m["candidate_start"], m["candidate_end"])
        assert (b.reference_start, b.reference_end) == (m["reference_start"], m["reference_end"])
        # The final-gap limit's level is where the verdict's gap reaches its limit.
        gap_at_level = (b.final_level - b.reference_end) / b.reference_end
        assert gap_at_level == pytest.approx(b.final_gap_limit)


def test_the_trial_command_draws_with_this_module_and_writes_a_png(tmp_path):
    assert trial_cli.plot_trials is plot_trials
    reference, evaluations = _nan()
    path = tmp_path / "trial.png"
    plot_trials(str(path), reference, evaluations)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_plot_never_writes_through_a_link_planted_at_its_name(tmp_path):
    reference, evaluations = _nan()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    path = tmp_path / "trial.png"
    path.symlink_to(victim)
    plot_trials(str(path), reference, evaluations)
    assert victim.read_text() == "keep me\n"
    assert not path.is_symlink() and path.read_bytes()[:4] == b"\x89PNG"


def test_a_plot_takes_the_format_its_extension_names(tmp_path):
    reference, evaluations = _nan()
    plot_trials(str(tmp_path / "trial.svg"), reference, evaluations)
    assert b"<svg" in (tmp_path / "trial.svg").read_bytes()[:400]
    with pytest.raises(MpadviseError, match="cannot write plot .*trial.nope"):
        plot_trials(str(tmp_path / "trial.nope"), reference, evaluations)
    assert not (tmp_path / "trial.nope").exists()


def test_without_matplotlib_one_clear_line(monkeypatch):
    reference, evaluations = _nan()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(MpadviseError, match=r'--plot needs matplotlib; install it with: pip install "mpadvise\[plot\]"'):
        plot_module.trial_figure(reference, evaluations)


def test_an_unwritable_path_is_one_clear_line(tmp_path):
    reference, evaluations = _nan()
    with pytest.raises(MpadviseError, match="cannot write plot"):
        plot_trials(str(tmp_path / "missing" / "trial.png"), reference, evaluations)


class _TimeoutRunner:
    """Stands in for ScriptRunner (the subprocess boundary): fp32 trains, bf16-mixed times out."""

    def __init__(self, path, script_args, settings, *, launch=None, warm=None) -> None:
        self.settings = settings

    def __call__(self, policy, label):
        if policy.mode == "fp32":
            return _result("fp32", [1.0 - 0.01 * i for i in range(40)])
        return TrialResult(outcome="timeout", label=label, policy=policy.to_dict(),
                           reason=f"no result within {self.settings.timeout:g} s (after 12 steps); the trial was killed")


def test_a_timeout_is_called_a_timeout_with_what_to_change(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from advisor.tune import TuneOptions
    from probes import HardwareProfile

    monkeypatch.setattr(trial_cli, "ScriptRunner", _TimeoutRunner)
    monkeypatch.setattr(trial_cli.probes, "profile_for", lambda device=None: HardwareProfile(kind="cpu", name="test cpu"))
    script = tmp_path / "train.py"
    script.write_text("import advisor\n")
    out = io.StringIO()
    options = TuneOptions(modes=["bf16-mixed"], device="cpu", timeout=15.0, steps=40)
    code = trial_cli.run_trial_command(script, [], options, plot=None, json_output=False,
                                       console=Console(file=out, width=200), stream=trial_cli.TrialStream(None))
    text = " ".join(out.getvalue().split())
    assert "bf16-mixed timed out" in text and "not a stability verdict" in text
    assert "--timeout 30" in text and "--steps 32" in text
    assert code == trial_cli.EXIT_UNSTABLE  # still not a stable candidate: nothing to recommend


@pytest.mark.parametrize(("where", "says"), [("missing/dir/trial.png", "does not exist"), (".", "it is a directory")])
def test_a_plot_path_that_cannot_be_written_is_refused_before_any_trial(tmp_path, monkeypatch, where, says):
    from typer.testing import CliRunner

    from advisor.cli._app import app

    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")

    def no_trial(*args, **kwargs):
        raise AssertionError("a trial ran although the plot path should have been refused first")

    monkeypatch.setattr(trial_cli, "ScriptRunner", no_trial)
    result = CliRunner().invoke(app, ["trial", str(script), "-m", "bf16-mixed", "--plot", str(tmp_path / where)])
    assert result.exit_code == 2, result.output  # a bad --plot value: a usage error
    assert f"cannot write plot {tmp_path / where}" in result.output and says in result.output
    assert "Traceback" not in result.output


def test_a_trial_too_short_for_a_verdict_is_told_so_before_it_runs(tmp_path, monkeypatch, caplog):
    from typer.testing import CliRunner

    from advisor.cli._app import app

    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n")
    ran = []

    def no_trial(*args, **kwargs):
        ran.append(True)
        raise MpadviseError("stop here")

    monkeypatch.setattr(trial_cli, "ScriptRunner", no_trial)
    logger = get_logger()  # it writes to stderr and does not propagate: listen to it directly
    logger.addHandler(caplog.handler)
    try:
        CliRunner().invoke(app, ["trial", str(script), "-m", "bf16-mixed", "--steps", "10", "--warmup", "2"])
    finally:
        logger.removeHandler(caplog.handler)
    assert ran, "the trial itself is not refused: its speeds are worth measuring"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "gives 12 steps per trial" in said and "--steps 30 or more" in said and "too-short" in said
