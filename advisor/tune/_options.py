"""The tune options, declared once: ``mpadvise tune``'s flags, ``advisor.tune``'s keywords and a
daemon job's ``options`` are one frozen dataclass whose fields carry their help and rules."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, get_type_hints

from advisor.trial import DEFAULT_MEASURE_STEPS, DEFAULT_WARMUP_STEPS, parse_memory
from policies import canonical_mode, mode_names
from probes import MpadviseError, UsageError

# Options a stored daemon job may still carry from an earlier version, read and ignored:
# ``speedup_within`` asked for re-measurement rounds past the usual bound ("precision rounds").
RETIRED_OPTIONS = frozenset({"speedup_within"})


@dataclass(frozen=True)
class OptionInfo:
    """One tune option. ``job``: whether a daemon job may set it; ``job_limit``: the most a job may
    ask (a number, a list's length); ``trial``: whether ``mpadvise trial`` takes it too."""

    name: str
    type: Any
    default: Any
    help: str
    check: Callable[[OptionInfo, Any], Any]
    flags: tuple[str, ...]
    minimum: float | None = None
    above: bool = False
    job: bool = True
    job_limit: float | None = None
    trial: bool = False

    @property
    def flag(self) -> str:
        return self.flags[0]

    def refuse(self, value: Any, expected: str) -> UsageError:
        shown = f"{value:g}" if isinstance(value, float) else repr(value)
        return UsageError(f"{self.flag} {shown} is not allowed; expected {expected}")


def _typed(option: OptionInfo, value: Any, *, types: type | tuple[type, ...], expected: str) -> Any:
    if not isinstance(value, types):
        raise option.refuse(value, expected)
    return value


def _bounded(option: OptionInfo, value: Any, *, types: tuple[type, ...], words: str) -> Any:
    # Written so that NaN fails both comparisons.
    if (isinstance(value, bool) or not isinstance(value, types)
            or not (value > option.minimum if option.above else value >= option.minimum)):
        raise option.refuse(value, f"{words} {'>' if option.above else '>='} {option.minimum:g}")
    return value


_switch = functools.partial(_typed, types=bool, expected="True or False")
_text = functools.partial(_typed, types=str, expected="text")
_whole_number = functools.partial(_bounded, types=(int,), words="a whole number")
_seconds = functools.partial(_bounded, types=(int, float), words="seconds")


def _mode_names(option: OptionInfo, value: Any) -> tuple[str, ...]:
    # A bare string is a sequence too; taking it letter by letter would hide the mistake.
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise option.refuse(value, "a list of mode names, e.g. ['bf16-mixed', 'fp16-mixed']")
    # Any case, and Lightning's names (16-mixed, bf16-true, 32...), mean our modes; an unknown
    # name is a usage error that suggests the closest.
    return tuple(canonical_mode(v) for v in value)


def _memory_size(option: OptionInfo, value: Any) -> str | int | None:
    if value == "":  # an empty --memory-limit means no limit, as leaving it out does
        return None
    if isinstance(value, str):
        try:
            parse_memory(value)
        except MpadviseError as exc:  # its message names the value and the accepted forms
            raise UsageError(str(exc)) from None
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise option.refuse(value, "a size such as 4GiB, or a number of bytes > 0")
    return value


def _config_path(option: OptionInfo, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise option.refuse(value, "a file path")
    # Refused before any trial runs; Policy.save refuses any other existing non-config file.
    path = os.fspath(value)
    if path.lower().endswith(".py"):
        raise option.refuse(path, "a config file path (.toml), not a Python file the tune would replace")
    return path


_FRAMEWORK_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")


def _framework(option: OptionInfo, value: Any) -> str:
    # Which frameworks exist is the frameworks registry's to say (a layer above); the name goes on
    # as given, in any case, so that the registry's refusal quotes what the user wrote.
    if not isinstance(value, str) or not _FRAMEWORK_NAME.fullmatch(value.lower()):
        raise option.refuse(value, "a framework name such as lightning")
    return value


def _option(default: Any, help: str, check: Callable[[OptionInfo, Any], Any], **rules: Any) -> Any:
    return field(default=default, metadata={"option": {"help": help, "check": check, **rules}})


@dataclass(frozen=True)
class TuneOptions:
    """Every option of a tune, in ``mpadvise tune --help``'s order; an invalid value raises
    UsageError naming the flag, the value and what is allowed."""

    trials: int = _option(20, "Trial budget of the search (the reference not counted).", _whole_number,
                          minimum=1, job_limit=10_000)
    time_budget: float | None = _option(None, "Seconds after which no new trial, of the search or of re-measurement, "
                                        "starts.", _seconds, minimum=0, above=True, job_limit=30 * 86400)
    steps: int = _option(DEFAULT_MEASURE_STEPS, "Measured optimizer steps per trial (after the warm-up).", _whole_number,
                         minimum=1, job_limit=1_000_000, trial=True)
    warmup: int = _option(DEFAULT_WARMUP_STEPS, "Warm-up steps per trial, not timed.", _whole_number, minimum=0,
                          job_limit=100_000, trial=True)
    modes: tuple[str, ...] = _option((), f"Candidate modes ({', '.join(mode_names())}; Lightning's 16-mixed, "
                                     "bf16-true, 32-true... too); repeat for several. Default: every mode this hardware "
                                     "supports.", _mode_names, flags=("--mode", "-m"), job_limit=16, trial=True)
    scale_batch: bool = _option(False, "Also try larger global batches (changes the optimisation).", _switch)
    include_emulated: bool = _option(False, "Also search FP8 emulated on a CPU.", _switch)
    memory_limit: str | int | None = _option(
        None, "e.g. 4GiB: a real cap on CUDA, a verdict on peak RSS on CPU; a candidate above it is infeasible.",
        _memory_size, trial=True)
    timeout: float = _option(600.0, "Seconds before a trial is killed.", _seconds, minimum=0, above=True,
                             job_limit=7 * 86400, trial=True)
    first_step_timeout: float = _option(
        120.0, "Seconds a trial may take from the candidate's application (load_policy(), or the framework's "
        "trainer built) to its first optimizer step, time spent compiling not counted.", _seconds, minimum=0,
        above=True, job_limit=7 * 86400, trial=True)
    seed: int = _option(0, "Seed shared by every trial and the sampler.", _whole_number, minimum=0,
                        job_limit=2**31 - 1, trial=True)
    device: str | None = _option(None, "cpu or cuda:N; default: the first GPU, else the CPU.", _text, job=False,
                                 trial=True)
    framework: str | None = _option(
        None, "How the script trains (lightning, fabric, ...); default: read from its imports.",
        _framework, trial=True)
    # Not for daemon jobs: the daemon gives each job one GPU slot.
    nproc_per_node: int = _option(1, "Processes per trial, launched through torchrun (one per GPU).", _whole_number,
                                  minimum=1, job=False, trial=True)
    storage: str | None = _option(None, "Optuna storage URL; default: MPADVISE_STORAGE, else the first line of the "
                                  "private file MPADVISE_STORAGE_FILE names (either keeps a password out of ps), else "
                                  "an SQLite file in the cache directory.", _text, job=False)
    resume: bool = _option(
        False, "Continue the stored study, even one whose answer is kept (a tune interrupted is continued without "
        "it); a study whose workload changed since (the model, optimizer or batch the script built) is not continued: "
        "it is refused, its trials kept, or, with no finished trial, a warning and a fresh study.", _switch)
    fresh: bool = _option(
        False, "Delete the stored study's finished trials and start afresh; without it, a tune that finished prints "
        "its kept answer again and runs no trial, and one interrupted is continued.", _switch)
    out: str | None = _option(None, "Config file to write; default: <script>.mpadvise.toml beside it.", _config_path)
    no_cache: bool = _option(False, "Do not store the answer in the per-GPU cache.", _switch)
    no_priors: bool = _option(False, "Measure candidates even when the matmul priors say they cannot win.", _switch)

    def __post_init__(self) -> None:
        for option in option_info():
            value = getattr(self, option.name)
            if value is not None or option.default is not None:  # frozen: normalised once, here
                object.__setattr__(self, option.name, option.check(option, value))
        check_rank_device(self.nproc_per_node, self.device)
        if self.resume and self.fresh:
            raise UsageError("--resume and --fresh cannot be used together: --resume continues the stored study, "
                             "--fresh deletes it; choose one")

    @property
    def memory_limit_bytes(self) -> int | None:
        return parse_memory(self.memory_limit) if isinstance(self.memory_limit, str) else self.memory_limit

    def with_(self, **changes: Any) -> TuneOptions:
        """A copy with some options changed, validated again (UsageError for an unknown name)."""
        _check_names(changes)
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneOptions:
        """Options from a plain dict: missing keys keep their defaults, ``RETIRED_OPTIONS`` are dropped."""
        data = {k: v for k, v in data.items() if k not in RETIRED_OPTIONS}
        _check_names(data)
        return cls(**data)

    def to_dict(self, *, job: bool = False) -> dict[str, Any]:
        """A JSON-ready dict of every option (with ``job``, only those a daemon job may set)."""
        values = {option.name: getattr(self, option.name) for option in option_info() if option.job or not job}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}

    def to_argv(self) -> list[str]:
        """The ``mpadvise tune`` options that give these values; defaults are left out."""
        argv: list[str] = []
        for option in option_info():
            value = getattr(self, option.name)
            if value == option.default:
                continue
            if isinstance(value, bool):  # every switch is off by default: on is its flag alone
                argv.append(option.flag)
            elif isinstance(value, tuple):
                for item in value:
                    argv += [option.flag, item]
            else:
                argv += [option.flag, str(value)]
        return argv


def check_rank_device(nproc_per_node: int, device: str | None) -> None:
    """Refuse one numbered GPU (``cuda:N``) for the processes of a multi-process trial."""
    if nproc_per_node > 1 and device is not None and device.startswith("cuda:"):
        raise UsageError(
            f"--device {device} cannot be used with --nproc-per-node {nproc_per_node}: each process "
            "trains on its own GPU (cuda:LOCAL_RANK); use --device cuda, or leave it out"
        )


@functools.cache
def option_info() -> tuple[OptionInfo, ...]:
    hints = get_type_hints(TuneOptions)
    return tuple(OptionInfo(f.name, hints[f.name], f.default,
                            **{"flags": (f"--{f.name.replace('_', '-')}",), **f.metadata["option"]})
                 for f in fields(TuneOptions))


def _check_names(data: Mapping[str, Any]) -> None:
    names = [option.name for option in option_info()]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise UsageError(f"unknown tune option {', '.join(map(repr, unknown))}; expected some of {', '.join(names)}")
