"""One tune of a training script, end to end: the service behind ``mpadvise tune`` and the
daemon's jobs (through :mod:`advisor.tune.job`): study, storage, trials, config file and cache.

How the script's trials start is the frameworks package's decision, a layer above this one: the
caller makes it (``advisor.frameworks.plan_for``) and passes it in as a :class:`ScriptLaunch`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import probes
from advisor._log import get_logger
from advisor._paths import cache_dir, config_path_for
from advisor._secure import ensure_private_dir, ensure_private_file, open_private_new
from advisor.cache import guard_events_for, record_tune
from advisor.runtime import script_digest
from advisor.trial import WarmLauncher
from advisor.tune._checks import check_modes, check_script
from advisor.tune._engine import TuneResult, tune_policy
from advisor.tune._kept import StoredAnswer, answer_key, store_answer, stored_answer
from advisor.tune._options import TuneOptions
from advisor.tune._plan import late_unstable
from advisor.tune._space import SpaceLimits
from advisor.tune._stability import StabilityThresholds
from advisor.tune._storage import shared_storage, shown_url
from advisor.tune._study_status import check_storage, check_study, kept_study
from advisor.tune._trials import (
    WAIT_IDLE_ENV,
    Evaluation,
    Runner,
    ScriptRunner,
    TrialSettings,
    prestarted_launcher,
)
from policies import Policy, check_config_target
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

EXIT_FOUND, EXIT_NONE_STABLE = 0, 3  # a stable policy was found; none was

# ``progress(total)`` yields ``(on_start, on_done, on_round)`` for ``tune_policy``.
ProgressCallbacks = tuple[Callable[..., None], Callable[..., None], Callable[..., None]]
TuneProgress = Callable[[int], AbstractContextManager[ProgressCallbacks]]


def run_ratio_text(ev: Evaluation | None) -> str:
    """A progress line's words for one run's goodput over the fp32 reference run's (the tune's
    speed-up is decided later, from paired runs)."""
    if ev is None or not ev.speedup:
        return ""
    return f", this run {ev.speedup:.2f}x the fp32 reference run"


@dataclass(frozen=True)
class ScriptLaunch:
    """How the trials of one script start, as data (``advisor.frameworks.ScriptPlan``'s facts):
    ``framework`` is ``None`` for the loop API, ``limits`` bounds the search space."""

    framework: str | None = None
    detected: bool = False
    launch: tuple[str, ...] = ()
    limits: SpaceLimits | None = None
    label: str = "the loop API"

    @classmethod
    def of(cls, plan: Any) -> ScriptLaunch:  # an advisor.frameworks.ScriptPlan, a layer above
        return cls(plan.framework, plan.detected, tuple(plan.launch), plan.limits, plan.label)

    def to_dict(self) -> dict[str, Any]:
        limits = None if self.limits is None else {
            "modes": None if self.limits.modes is None else list(self.limits.modes),
            "micro_batch": self.limits.micro_batch, "loss_scale_kinds": list(self.limits.loss_scale_kinds),
            "loss_scale_settings": self.limits.loss_scale_settings, "why": self.limits.why}
        return {"framework": self.framework, "detected": self.detected, "launch": list(self.launch),
                "limits": limits, "label": self.label}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScriptLaunch:
        limits = data.get("limits")
        if limits is not None:
            modes = limits.get("modes")
            limits = SpaceLimits(modes=None if modes is None else tuple(modes), micro_batch=limits["micro_batch"],
                                 loss_scale_kinds=tuple(limits["loss_scale_kinds"]),
                                 loss_scale_settings=limits["loss_scale_settings"], why=limits.get("why", ""))
        return cls(data.get("framework"), bool(data.get("detected")), tuple(data.get("launch") or ()), limits,
                   data.get("label") or cls.label)


@dataclass(frozen=True)
class TuneRequest:
    """One tune of a script: what ``mpadvise tune`` and a daemon job ask of :func:`tune_script`."""

    script: Path
    args: tuple[str, ...] = ()
    options: TuneOptions = field(default_factory=TuneOptions)
    launch: ScriptLaunch = field(default_factory=ScriptLaunch)

    def to_dict(self) -> dict[str, Any]:
        return {"script": str(self.script), "args": list(self.args), "options": self.options.to_dict(),
                "launch": self.launch.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneRequest:
        """Raises:
            MpadviseError: a missing or unknown key, or an option value out of bounds.
        """
        unknown = sorted(set(data) - {"script", "args", "options", "launch"})
        if unknown or "script" not in data:
            raise MpadviseError(f"tune request: expected the keys script, args, options and launch, got {sorted(data)}")
        return cls(Path(data["script"]), tuple(str(a) for a in data.get("args") or ()),
                   TuneOptions.from_dict(data.get("options") or {}), ScriptLaunch.from_dict(data.get("launch") or {}))


@dataclass
class ScriptTune:
    """A finished tune of a script and where its answer went; ``result`` is ``None`` and ``stored``
    set for an answer read back from its study."""

    result: TuneResult | None
    request: TuneRequest
    profile: HardwareProfile
    study_name: str
    config_file: Path | None = None
    cache_id: int | None = None
    calls_load_policy: bool = False
    stored: StoredAnswer | None = None

    @property
    def already_tuned(self) -> str | None:
        return None if self.stored is None else self.stored.at

    @property
    def exit_code(self) -> int:
        if self.result is None:
            return EXIT_FOUND if self.to_dict().get("winner") is not None else EXIT_NONE_STABLE
        return EXIT_FOUND if self.result.policy is not None else EXIT_NONE_STABLE

    def to_dict(self) -> dict[str, Any]:
        """What ``mpadvise tune --json`` prints and a daemon job stores; for an answer read back, the
        JSON its tune printed, unchanged."""
        if self.stored is not None:
            return json.loads(json.dumps(self.stored.payload))
        assert self.result is not None
        request = self.request
        payload = self.result.to_dict()
        payload.update(
            script=str(request.script), args=list(request.args), framework=request.launch.framework,
            calls_load_policy=self.calls_load_policy,
            config_file=str(self.config_file) if self.config_file else None, cache_id=self.cache_id,
            storage=shown_url(request.options.storage), study_name=self.study_name,
            hardware={"name": self.profile.name, "fingerprint": hardware_fingerprint(self.profile)},
        )
        return payload


def tune_script(request: TuneRequest, *, progress: TuneProgress | None = None,
                profile: HardwareProfile | None = None, runner: Runner | None = None,
                warm: WarmLauncher | None = None) -> ScriptTune:
    """Tune a script end to end: check it, open the study, run the trials, write the config
    file and cache the answer. ``warm`` (default: one started here, before the probe) is ended when
    the tune ends.

    Raises:
        MpadviseError: a bad script, mode or storage; a study of other hardware; the fp32
            reference failed.
    """
    path = check_script(request.script)
    if runner is None and warm is None:
        # The server imports while this process probes the hardware and benchmarks its matmuls.
        warm = prestarted_launcher(path, request.args, request.launch.launch,
                                   nproc_per_node=request.options.nproc_per_node)
    try:
        return _tune_script(request, path, progress, profile, runner, warm)
    finally:
        if warm is not None:
            warm.close()


def _tune_script(request: TuneRequest, path: Path, progress: TuneProgress | None, profile: HardwareProfile | None,
                 runner: Runner | None, warm: WarmLauncher | None) -> ScriptTune:
    profile = profile or probes.profile_for(request.options.device)
    options = _resolved(request.options.with_(framework=request.launch.framework), profile)
    request = TuneRequest(path, tuple(request.args), options, request.launch)
    # The config file is written at the end: a path it cannot take is refused before any trial,
    # as is a window too short for any verdict (every candidate, fp32 too, would be too-short).
    check_config_target(_config_out(options, path))
    check_config_args(_config_out(options, path), path, request.args)
    check_judgeable_window(options)
    fingerprint = hardware_fingerprint(profile)
    study_name = study_name_for(path, list(request.args), fingerprint, processes=options.nproc_per_node)
    # A mode a long run's guard found unstable is not tuned again, and an answer kept before that
    # run no longer holds.
    late = late_unstable(guard_events_for(profile, path))
    key = {**answer_key(options, profile), "late": sorted(late)} if late else answer_key(options, profile)
    if not (options.fresh or options.resume):
        kept = stored_answer(options.storage, study_name, key)
        if kept is not None:
            return _answer_again(kept, request, profile, study_name, path)
        options = _continue_kept(options, study_name)
        request = TuneRequest(path, tuple(request.args), options, request.launch)
    check_study(options.storage, study_name, hardware=fingerprint, resume=options.resume, fresh=options.fresh)
    launch = request.launch
    if launch.framework is not None:
        how = "read from its imports" if launch.detected else "--framework"
        get_logger().info(f"{path.name} trains with {launch.label} ({how}): the search covers what it can apply")
    if runner is None:
        # Under the daemon, every trial first waits until no other process computes on the GPU.
        wait_idle_on = profile if os.environ.get(WAIT_IDLE_ENV) else None
        runner = ScriptRunner(path, list(request.args), TrialSettings.for_tune(options), wait_idle_on=wait_idle_on,
                              launch=launch.launch, warm=warm)
    # The budget plus the reference and its replicate; then each round of re-measurement.
    silent = (lambda *a: None,) * 3
    with (progress or (lambda total: nullcontext(silent)))(options.trials + 2) as (on_start, on_done, on_round):
        result = tune_policy(runner, profile, options, study_name=study_name, workload={"script": str(path)},
                             on_start=on_start, on_done=on_done, on_round=on_round, limits=launch.limits, late=late)
    config_file, cache_id = keep_answer(result, options, profile, path, request.args, framework=launch.framework)
    done = ScriptTune(result, request, profile, study_name, config_file, cache_id, calls_load_policy(path))
    config_text = None
    if config_file is not None:
        with suppress(OSError, UnicodeDecodeError):
            config_text = config_file.read_text(encoding="utf-8")
    store_answer(options.storage, study_name, key, json.loads(json.dumps(done.to_dict(), default=str)), config_text)
    return done


def _continue_kept(options: TuneOptions, study_name: str) -> TuneOptions:
    """Continue a study of this machine that holds finished trials and no answer that still holds,
    saying so; its trials are never deleted unasked (``--fresh`` does)."""
    if options.storage is None or shared_storage(options.storage):
        return options
    held = kept_study(options.storage, study_name)
    if held is None or not held.finished:
        return options
    plural = "" if held.finished == 1 else "s"
    when = f" from {held.last}" if held.last else ""
    get_logger().info(f"resuming study {study_name!r}: {held.finished} finished trial{plural}{when} kept "
                         "(mpadvise tune --fresh starts afresh)")
    return options.with_(resume=True)


def _answer_again(kept: StoredAnswer, request: TuneRequest, profile: HardwareProfile, study_name: str,
                  path: Path) -> ScriptTune:
    """The answer a finished tune of this study gave; its config file is written again if gone."""
    payload = kept.payload
    written = payload.get("config_file")
    if written and kept.config_text is not None and not Path(written).exists():
        with suppress(OSError):
            Path(written).write_text(kept.config_text, encoding="utf-8")
    config_file = Path(written) if written else None
    return ScriptTune(None, request, profile, study_name, config_file, payload.get("cache_id"),
                      bool(payload.get("calls_load_policy", calls_load_policy(path))), stored=kept)


def keep_answer(result: TuneResult, options: TuneOptions, profile: HardwareProfile, script: Path,
                args: Sequence[str], *, framework: str | None = None) -> tuple[Path | None, int | None]:
    """Write the winner's config file and cache it (unless ``options.no_cache``); returns the file
    and the cache entry, ``None`` for each without a winner."""
    if result.policy is None:
        return None, None
    policy = result.policy
    if policy.tuned_on is not None:
        # The arguments go into the file, so that a tune with others refuses to replace it
        # (check_config_args) and a run with others can say which it was tuned for.
        policy = policy.with_(tuned_on=replace(policy.tuned_on, args=tuple(str(arg) for arg in args)))
    written = policy.save(_config_out(options, script), framework=framework)
    return written, None if options.no_cache else remember(result, profile, script, args)


def check_config_args(path: Path, script: Path, args: Sequence[str]) -> None:
    """Refuse, before any trial, a tune that would replace a config file tuned with other
    arguments of the script (a file that does not record its arguments is replaced as before).

    Raises:
        UsageError: the file at ``path`` was tuned with other arguments.
    """
    try:
        existing = Policy.from_toml(path.read_text(encoding="utf-8"), source=str(path))
    except (OSError, UnicodeDecodeError, MpadviseError):
        return  # no file, or not one to compare (check_config_target judged whether it may be replaced)
    tuned = existing.tuned_on
    here = tuple(str(arg) for arg in args)
    if tuned is None or tuned.args is None or tuned.args == here:
        return
    raise UsageError(
        f"{path} holds the answer tuned for {_command(script, tuned.args)}, and this tune is for "
        f"{_command(script, here)}; replacing it would lose that answer: pass --out FILE to write this "
        f"one elsewhere (then MPADVISE_POLICY=FILE applies it), or delete {path.name} to replace it"
    )


def _command(script: Path, args: Sequence[str]) -> str:
    return f"`{shlex.join([script.name, *args])}`" + ("" if args else " (no arguments)")


def check_judgeable_window(options: TuneOptions, thresholds: StabilityThresholds | None = None) -> None:
    """Refuse, before any trial, a window (``--steps`` plus ``--warmup``) shorter than a verdict's
    ``min_steps``: every candidate, fp32 too, would end ``too-short``."""
    need = (thresholds or StabilityThresholds()).min_steps
    if options.steps + options.warmup < need:
        raise UsageError(
            f"--steps {options.steps} with --warmup {options.warmup} gives {options.steps + options.warmup} steps per "
            f"trial, and a verdict compares at least {need} (twice the 16 steps a loss scaler needs to settle); "
            f"use --steps {need - options.warmup} or more"
        )


def _config_out(options: TuneOptions, script: Path) -> Path:
    return Path(options.out) if options.out is not None else config_path_for(script)


def _resolved(options: TuneOptions, profile: HardwareProfile) -> TuneOptions:
    """The options with their modes checked on this hardware and the study storage chosen (and
    opened once, so a bad URL fails before any trial runs)."""
    modes = check_modes(list(options.modes), profile) if options.modes else []
    storage = options.storage if options.storage is not None else default_storage()
    check_storage(storage)
    return options.with_(modes=modes, storage=storage)


def default_storage_url() -> str:
    return f"sqlite:///{cache_dir() / 'studies.db'}"


def default_storage() -> str | None:
    """The study database in the cache directory, made private, or ``None`` (in memory) when unusable."""
    directory = cache_dir()
    study = directory / "studies.db"
    try:
        ensure_private_dir(directory)
        if not ensure_private_file(study):
            # Made here, private, before SQLite would make it under the umask (0644): the study's
            # trials name this machine's workers and the script's arguments.
            with suppress(FileExistsError):  # another tune made it a moment ago
                os.close(open_private_new(study))
        probe = directory / f".write-test-{os.getpid()}"
        os.close(open_private_new(probe))
        probe.unlink()
    except MpadviseError as exc:
        get_logger().warning(f"{exc}; the study is kept in memory, so --resume will not work")
        return None
    except OSError as exc:
        get_logger().warning(f"cache directory {directory} is not writable ({exc.strerror or exc}); the study is kept "
                             "in memory, so --resume will not work")
        return None
    return default_storage_url()


def study_name_for(script: Path, args: list[str], fingerprint: str, *, processes: int = 1) -> str:
    return study_name_from(script.name, script_digest(script), args, fingerprint, processes=processes)


def study_name_from(script_name: str, content_digest: str | None, args: list[str], fingerprint: str, *,
                    processes: int = 1) -> str:
    """The study's name: the script's stem, the hardware fingerprint, and a digest of the file
    name, content, arguments and (above one) processes per trial, so that measurements that would
    not compare never share a study."""
    facts: list[object] = [script_name, content_digest, args, fingerprint]
    if processes > 1:  # one process keeps the name it always had
        facts.append({"nproc_per_node": processes})
    digest = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:12]
    return f"{Path(script_name).stem}-{fingerprint}-{digest}"


def calls_load_policy(script: Path) -> bool:
    """Whether the script's source calls advisor's ``load_policy`` (under any name it is imported
    as), so that the report does not ask for a line it already has."""
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    packages, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            packages.update(alias.asname or alias.name for alias in node.names if alias.name == "advisor")
        elif isinstance(node, ast.ImportFrom) and node.module == "advisor":
            functions.update(alias.asname or alias.name for alias in node.names if alias.name == "load_policy")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in functions:
            return True
        if (isinstance(func, ast.Attribute) and func.attr == "load_policy" and isinstance(func.value, ast.Name)
                and func.value.id in packages):
            return True
    return False


def remember(result: TuneResult, profile: HardwareProfile, script: str | os.PathLike[str],
             args: Sequence[str] | None) -> int | None:
    """Record a tune's winner in the cache, with its trials; returns the entry's id, ``None``
    without a winner, a workload fingerprint, or a usable cache."""
    tuned_on = None if result.policy is None else result.policy.tuned_on
    if result.policy is None or tuned_on is None or not tuned_on.workload_fingerprint:
        return None
    return record_tune(
        profile=profile, policy=result.policy, script=script, workload_fingerprint=tuned_on.workload_fingerprint,
        trials=cache_rows(result), speedup_vs_fp32=tuned_on.speedup_vs_fp32, goodput=tuned_on.goodput,
        args=None if args is None else list(args), utilisation=_winner_utilisation(result),
        reference_losses=result.reference.result.losses,
    )


def _winner_utilisation(result: TuneResult) -> dict[str, Any] | None:
    found = None if result.winner is None else result.utilisation(result.winner)
    if found is None:
        return None
    return {**found.to_dict(), "flops_per_step": result.reference.result.flops_per_step,
            "flops_basis": result.reference.result.flops_basis}


def cache_rows(result: TuneResult) -> list[dict[str, Any]]:
    """The trial rows the cache keeps for a tune, ranked; the winner's carries the speed-up."""
    speedup = result.speedup.to_dict() if result.speedup else {}
    rows = []
    for number, (cand, m) in enumerate(result.ranking()):
        found = result.utilisation(cand)
        metrics: dict[str, Any] = {"feasible": m.feasible, "label": cand.label,
                                   "tflops": None if found is None else found.tflops,
                                   "mfu": None if found is None else found.mfu,
                                   # A row's goodput is one run's; the entry's own is the winner's re-measured one.
                                   "goodput_basis": "resumed" if result.resumed(cand) else "search run"}
        if cand == result.winner:
            metrics.update({f"speedup_{k}": v for k, v in speedup.items()})
        rows.append({
            "number": number, "mode": cand.mode, "params": cand.params(), "outcome": m.outcome or "ok",
            "verdict": "stable" if m.stable else "not stable", "reason": m.reason, "goodput": m.goodput,
            "metrics": metrics,
        })
    return rows
