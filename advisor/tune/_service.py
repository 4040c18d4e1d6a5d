"""One tune of a training script, end to end (``mpadvise tune`` and the daemon's jobs): study,
storage, trials, config file and cache; ``advisor.tune(train_fn)`` tunes a function in this
process. ``tune_plan`` (``--dry-run``) runs a tune's checks and describes its plan, and writes
nothing. How trials start is the frameworks package's decision (a layer above): the caller
passes it in as a :class:`ScriptLaunch`.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import asdict, dataclass, field, replace
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
from advisor.tune._judge import Evaluation
from advisor.tune._options import TuneOptions
from advisor.tune._plan import late_unstable
from advisor.tune._run import (
    WAIT_IDLE_ENV,
    FunctionRunner,
    Runner,
    ScriptRunner,
    TrialSettings,
    prestarted_launcher,
)
from advisor.tune._search import loss_scale_choices
from advisor.tune._space import SpaceLimits, micro_batch_choices, scales_loss, space_for
from advisor.tune._stability import StabilityThresholds
from advisor.tune._storage import shared_storage, shown_url
from advisor.tune._study_status import (
    KeptStudy,
    StoredAnswer,
    answer_key,
    check_storage,
    check_study,
    kept_study,
    store_answer,
    stored_answer,
)
from policies import Policy, check_config_target, mode_dtypes, supported_modes
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

EXIT_FOUND, EXIT_NONE_STABLE = 0, 3  # a stable policy was found; none was

# ``progress(total)`` yields ``(on_start, on_done, on_round)`` for ``tune_policy``.
ProgressCallbacks = tuple[Callable[..., None], Callable[..., None], Callable[..., None]]
TuneProgress = Callable[[int], AbstractContextManager[ProgressCallbacks]]


def run_ratio_text(ev: Evaluation | None) -> str:
    """A progress line's words for one run's goodput over fp32's run (not the tune's speed-up)."""
    return f", this run {ev.speedup:.2f}x the fp32 reference run" if ev is not None and ev.speedup else ""


@dataclass(frozen=True)
class ScriptLaunch:
    """How a script's trials start: ``advisor.frameworks.ScriptPlan``'s facts."""

    framework: str | None = None
    detected: bool = False
    launch: tuple[str, ...] = ()
    limits: SpaceLimits | None = None
    label: str = "the loop API"

    @classmethod
    def of(cls, plan: Any) -> ScriptLaunch:  # an advisor.frameworks.ScriptPlan, a layer above
        return cls(plan.framework, plan.detected, tuple(plan.launch), plan.limits, plan.label)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # JSON writes its tuples as lists

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScriptLaunch:
        limits = data.get("limits")
        if limits is not None:
            modes = limits.get("modes")
            limits = SpaceLimits(**{**limits, "modes": None if modes is None else tuple(modes),
                                    "loss_scale_kinds": tuple(limits["loss_scale_kinds"])})
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
        unknown = sorted(set(data) - {"script", "args", "options", "launch"})
        if unknown or "script" not in data:
            raise MpadviseError(f"tune request: expected the keys script, args, options and launch, got {sorted(data)}")
        return cls(Path(data["script"]), tuple(str(a) for a in data.get("args") or ()),
                   TuneOptions.from_dict(data.get("options") or {}), ScriptLaunch.from_dict(data.get("launch") or {}))


@dataclass
class ScriptTune:
    """A finished tune of a script and where its answer went (``stored``, not ``result``, for an
    answer read back from its study)."""

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
        found = self.to_dict().get("winner") if self.result is None else self.result.policy
        return EXIT_FOUND if found is not None else EXIT_NONE_STABLE

    def to_dict(self) -> dict[str, Any]:
        """What ``mpadvise tune --json`` prints and a daemon job stores."""
        if self.stored is not None:
            return json.loads(json.dumps(self.stored.payload))
        assert self.result is not None
        request = self.request
        return {**self.result.to_dict(), "script": str(request.script), "args": list(request.args),
                "framework": request.launch.framework, "calls_load_policy": self.calls_load_policy,
                "config_file": str(self.config_file) if self.config_file else None, "cache_id": self.cache_id,
                "storage": shown_url(request.options.storage), "study_name": self.study_name,
                "hardware": {"name": self.profile.name, "fingerprint": hardware_fingerprint(self.profile)}}


def tune_script(request: TuneRequest, *, progress: TuneProgress | None = None,
                profile: HardwareProfile | None = None, runner: Runner | None = None,
                warm: WarmLauncher | None = None) -> ScriptTune:
    """Tune a script end to end; ``warm`` (default: one started here) is ended when it ends."""
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
    # The storage is opened once here, so that a bad URL fails before any trial runs.
    storage = request.options.storage if request.options.storage is not None else default_storage()
    check_storage(storage)
    options, fingerprint, study_name = _checked(request, path, profile, storage)
    check_config_args(_config_out(options, path), path, request.args)
    # Modes a long run's guard found unstable are not tuned again; an answer kept before is stale.
    late = late_unstable(guard_events_for(profile, path))
    key = {**answer_key(options, profile), "late": sorted(late)} if late else answer_key(options, profile)
    if not (options.fresh or options.resume):
        kept = stored_answer(options.storage, study_name, key)
        if kept is not None:
            # The answer a finished tune of this study gave; its config file is written again if gone.
            written = kept.payload.get("config_file")
            if written and kept.config_text is not None and not Path(written).exists():
                with suppress(OSError):
                    Path(written).write_text(kept.config_text, encoding="utf-8")
            return ScriptTune(None, replace(request, script=path, options=options), profile, study_name,
                              Path(written) if written else None, kept.payload.get("cache_id"), stored=kept)
        # A study of this machine with finished trials and no answer that holds is continued.
        held = None if shared_storage(options.storage) else kept_study(options.storage, study_name)
        if held is not None and held.finished:
            get_logger().info(f"resuming study {study_name!r}: {held.trials} kept "
                              "(mpadvise tune --fresh starts afresh)")
            options = options.with_(resume=True)
    request = replace(request, script=path, options=options)
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


def tune(
    train_fn: Callable[[Any], Any], options: TuneOptions | None = None, *,
    thresholds: StabilityThresholds | None = None, remeasure: bool = True, study_name: str = "mpadvise-in-process",
    **option_values: Any,
) -> TuneResult:
    """Tune a training function in this process, as ``mpadvise tune`` tunes a script.

    ``train_fn(mp)`` receives the candidate's AppliedPolicy and builds its model and data inside,
    so every candidate starts from the same seed. Out-of-memory and crashes are classified, not
    raised (a segfault takes the process with it). The winner is cached under the file that defines
    ``train_fn`` (not a notebook cell), so that its ``advisor.load_policy()`` finds it.

    Args:
        train_fn: the training function.
        options: the tune's options, as ``mpadvise tune`` takes them (:class:`TuneOptions`).
        thresholds: stability thresholds.
        remeasure: re-measure close candidates, and the winner against fp32 for its speed-up.
        study_name: the Optuna study's name in ``storage``.
        **option_values: :class:`TuneOptions` fields by name, over ``options`` (``storage``
            defaults to memory; a stored study with finished trials needs ``resume`` or ``fresh``).

    Returns:
        A TuneResult: ``.policy`` is the winner (``None`` when nothing was stable).
    """
    options = (options or TuneOptions()).with_(**option_values)
    profile = probes.profile_for(options.device)
    check_study(options.storage, study_name, hardware=hardware_fingerprint(profile), resume=options.resume,
                fresh=options.fresh, spelling=("resume=True", "fresh=True"))
    runner = FunctionRunner(train_fn, TrialSettings.for_tune(options))
    result = tune_policy(
        runner, profile, options, study_name=study_name, thresholds=thresholds, remeasure=remeasure,
        workload={"script": getattr(train_fn, "__qualname__", None)},
    )
    if options.out is not None and result.policy is not None:
        result.policy.save(Path(options.out))
    try:
        source = inspect.getsourcefile(train_fn)
    except TypeError:  # a builtin, or a callable object without code
        source = None
    if not options.no_cache and source is not None and Path(source).is_file():
        remember(result, profile, source, None)
    return result


def keep_answer(result: TuneResult, options: TuneOptions, profile: HardwareProfile, script: Path,
                args: Sequence[str], *, framework: str | None = None) -> tuple[Path | None, int | None]:
    """Write the winner's config file and cache it; returns both, ``None`` without a winner."""
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
    """Refuse, before any trial, to replace a config file tuned with other script arguments."""
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


def check_judgeable_window(options: TuneOptions) -> None:
    """Refuse, before any trial, a window shorter than a verdict's ``min_steps``."""
    need = StabilityThresholds().min_steps
    if options.steps + options.warmup < need:
        raise UsageError(
            f"--steps {options.steps} with --warmup {options.warmup} gives {options.steps + options.warmup} steps per "
            f"trial, and a verdict compares at least {need} (twice the 16 steps a loss scaler needs to settle); "
            f"use --steps {need - options.warmup} or more"
        )


def _checked(request: TuneRequest, path: Path, profile: HardwareProfile, storage: str | None
             ) -> tuple[TuneOptions, str, str]:
    options = request.options
    options = options.with_(framework=request.launch.framework, storage=storage,
                            modes=check_modes(list(options.modes), profile) if options.modes else [])
    # Refused before any trial: a config path the end cannot write, a window too short to judge.
    check_config_target(_config_out(options, path))
    check_judgeable_window(options)
    fingerprint = hardware_fingerprint(profile)
    return options, fingerprint, study_name_for(path, list(request.args), fingerprint,
                                                processes=options.nproc_per_node)


def _config_out(options: TuneOptions, script: Path) -> Path:
    return Path(options.out) if options.out is not None else config_path_for(script)


def default_storage_url() -> str:
    return f"sqlite:///{cache_dir() / 'studies.db'}"


def default_storage() -> str | None:
    """The study database in the cache directory, made private, or ``None`` (in memory) when unusable."""
    directory = cache_dir()
    try:
        ensure_private_dir(directory)
        if not ensure_private_file(directory / "studies.db"):
            # Made here, private, before SQLite would make it under the umask (0644): the study's
            # trials name this machine's workers and the script's arguments.
            with suppress(FileExistsError):  # another tune made it a moment ago
                os.close(open_private_new(directory / "studies.db"))
        probe = directory / f".write-test-{os.getpid()}"
        os.close(open_private_new(probe))
        probe.unlink()
    except (MpadviseError, OSError) as exc:
        why = exc if isinstance(exc, MpadviseError) else (
            f"cache directory {directory} is not writable ({exc.strerror or exc})")
        get_logger().warning(f"{why}; the study is kept in memory, so --resume will not work")
        return None
    return default_storage_url()


def study_name_for(script: Path, args: list[str], fingerprint: str, *, processes: int = 1) -> str:
    """The script's stem, the hardware fingerprint, and a digest of everything else measurements
    that compare share (file name, content, arguments, processes per trial above one)."""
    facts: list[object] = [script.name, script_digest(script), args, fingerprint]
    if processes > 1:  # one process keeps the name it always had
        facts.append({"nproc_per_node": processes})
    digest = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:12]
    return f"{script.stem}-{fingerprint}-{digest}"


def calls_load_policy(script: Path) -> bool:
    """Whether the script calls advisor's ``load_policy`` (under any name it is imported as)."""
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    packages, functions, called = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            packages.update(alias.asname or alias.name for alias in node.names if alias.name == "advisor")
        elif isinstance(node, ast.ImportFrom) and node.module == "advisor":
            functions.update(alias.asname or alias.name for alias in node.names if alias.name == "load_policy")
        elif isinstance(node, ast.Call):
            called.append(node.func)
    return any((isinstance(func, ast.Name) and func.id in functions)
               or (isinstance(func, ast.Attribute) and func.attr == "load_policy"
                   and isinstance(func.value, ast.Name) and func.value.id in packages)
               for func in called)


def remember(result: TuneResult, profile: HardwareProfile, script: str | os.PathLike[str],
             args: Sequence[str] | None) -> int | None:
    """Record a tune's winner in the cache, with its trials; returns the entry's id or ``None``."""
    tuned_on = None if result.policy is None else result.policy.tuned_on
    if result.policy is None or tuned_on is None or not tuned_on.workload_fingerprint:
        return None
    reference = result.reference.result
    found = None if result.winner is None else result.utilisation(result.winner)
    utilisation = None if found is None else {**found.to_dict(), "flops_per_step": reference.flops_per_step,
                                              "flops_basis": reference.flops_basis}
    return record_tune(
        profile=profile, policy=result.policy, script=script, workload_fingerprint=tuned_on.workload_fingerprint,
        trials=cache_rows(result), speedup_vs_fp32=tuned_on.speedup_vs_fp32, goodput=tuned_on.goodput,
        args=None if args is None else list(args), utilisation=utilisation, reference_losses=reference.losses,
    )


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


# A batch with halves and quarters, to count the micro-batch sizes a search may try before the
# fp32 reference reads the script's own.
_SPLITTABLE_BATCH = 64


def tune_plan(request: TuneRequest, profile: HardwareProfile) -> dict[str, Any]:
    """The search space and the plan of a tune (JSON-ready), checked as the tune would check them
    (a stored study it would not delete unasked is reported in ``plan.study_action``)."""
    path = check_script(request.script)
    launch = request.launch
    storage = request.options.storage if request.options.storage is not None else default_storage_url()
    if not storage.startswith("sqlite"):
        check_storage(storage)  # a server is only read; an SQLite file a tune would make is not made here
    options, fingerprint, study_name = _checked(request, path, profile, storage)
    held = kept_study(storage, study_name)
    if held is not None:  # a study it would continue must be of this hardware
        check_study(storage, study_name, hardware=fingerprint, resume=options.resume, fresh=True)
    support = supported_modes(profile)
    limits = launch.limits
    space = space_for(support, _SPLITTABLE_BATCH, include_emulated=options.include_emulated,
                      scale_batch=options.scale_batch, modes=options.modes or None, limits=limits)
    # The answer the tune would print again.
    answered = None if held is None or options.fresh or options.resume else stored_answer(
        storage, study_name, answer_key(options, profile))
    scaled = [mode for mode in space.modes if scales_loss(mode)]
    kinds, inits, growths = loss_scale_choices(limits or SpaceLimits()) if scaled else ([], [], [])
    return {
        "dry_run": True, "script": str(path), "args": list(request.args),
        "hardware": {"name": profile.name, "fingerprint": fingerprint},
        "space": {
            "modes": list(space.modes), "excluded": _excluded(support, space.modes, options, launch),
            "micro_batch": _micro_batch(options, launch),
            "loss_scale": {"modes": scaled, "kinds": kinds, "init_scales": inits,
                           "growth_intervals": growths},
            "candidates": len(space.grid()),
        },
        "plan": {
            "framework": launch.framework, "framework_detected": launch.detected, "trains_with": launch.label,
            "launch": [sys.executable, *launch.launch, str(path), *request.args],
            "processes_per_trial": options.nproc_per_node,
            "trials": options.trials, "reference_trials": 2, "steps": options.steps, "warmup": options.warmup,
            "time_budget_s": options.time_budget, "trial_timeout_s": options.timeout,
            "config_file": str(_config_out(options, path)), "cache": not options.no_cache,
            "study_name": study_name, "storage": shown_url(storage), "resume": options.resume,
            "study_action": _study_action(storage, held, options, answered),
        },
    }


def _excluded(support: dict[str, Any], searched: tuple[str, ...], options: TuneOptions,
              launch: ScriptLaunch) -> dict[str, str]:
    dtypes = mode_dtypes()
    out = {}
    for mode, info in support.items():
        if mode in searched:
            continue
        if not info.supported:
            reason = info.reason or "not supported on this hardware"
            out[mode] = reason.removeprefix(f"{mode}: ")
        elif options.modes and mode not in options.modes:
            out[mode] = "not asked for (--mode)"
        elif dtypes.get(mode) == "fp8" and info.emulated and not options.include_emulated:
            out[mode] = "emulated here (no speed-up); --include-emulated searches it"
        else:
            why = f" ({launch.limits.why})" if launch.limits is not None and launch.limits.why else ""
            out[mode] = f"{launch.label} cannot apply it{why}"
    return out


def _micro_batch(options: TuneOptions, launch: Any) -> str:
    if launch.limits is not None and not launch.limits.micro_batch:
        return f"the script's own batch only ({launch.label} cannot split it)"
    sizes = micro_batch_choices(_SPLITTABLE_BATCH, scale_batch=options.scale_batch)
    words = "the script's own batch (read by the fp32 reference), its half and quarter (accumulated back)"
    if options.scale_batch:
        words += ", its double and quadruple (--scale-batch changes the global batch)"
    return f"{words}: for a batch of {_SPLITTABLE_BATCH}, {', '.join(map(str, sizes))}"


def _study_action(storage: str, held: KeptStudy | None, options: TuneOptions, answered: StoredAnswer | None) -> str:
    finished = 0 if held is None else held.finished
    if shared_storage(storage):
        return f"join the shared study ({finished} finished trials so far)" if held else "make the shared study"
    if options.resume:
        return f"continue the stored study ({finished} finished trials)" if held else "make the study (none to resume)"
    if finished and options.fresh:
        return f"delete the stored study's {finished} finished trials (--fresh) and start afresh"
    if answered is not None:
        return f"print the answer it kept, tuned {answered.at}, and run no trial (--fresh tunes again)"
    if finished:
        return (f"continue the stored study's {finished} finished trials (a tune interrupted, or tuned with other "
                "options): --fresh deletes them and starts afresh")
    return "make the study afresh"
