"""The plain-PyTorch adapter: a hand-written loop that imports no framework and never calls
``load_policy()``, run with the candidate applied at torch's own seams (``_torch_hooks``); the
script's own precision flag (``--dtype``, ``--amp``...) is named in the notes (``precision_flag``).

Under ``mpadvise run`` the same step boundaries feed the runtime guard (``RunGuard``), whichever
framework drives the loop. The script's precision was set when it started, so a trip under
``fallback`` is a ``restart needed`` event, kept in the cache, where the next ``mpadvise run``
(and ``load_policy()``) applies the safer mode.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import probes
from advisor._log import get_logger
from advisor.frameworks._adapter import (
    FrameworkAdapter,
    around,
    hold_switches,
    shift_seed,
    wrap_once,
)
from advisor.frameworks._torch_hooks import (
    ForwardPrecision,
    Steps,
    before_clip,
    before_step,
    candidate_scaler_class,
    seen_line,
    wrap_backward,
)
from advisor.runtime import Guard, GuardEvent, GuardLimits, guard_fallback, guard_setting
from advisor.trial import EXIT_UNSUPPORTED, Stage, end_trial_process
from advisor.tune import StabilityThresholds
from policies import Policy, mode_facts

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

# The flags scripts commonly take their precision from, as argparse or a --key=value
# configurator spells them.
PRECISION_FLAGS = ("dtype", "amp", "fp16", "bf16", "precision", "mixed_precision")
_FLAG_VALUES: Mapping[str, Mapping[str, str]] = {
    # flag -> the candidate's facts ("fp32", "bf16-mixed", "fp16-mixed"...) -> what to pass
    "dtype": {"fp32": "--dtype=float32", "bf16": "--dtype=bfloat16", "fp16": "--dtype=float16"},
    "precision": {"fp32": "--precision=fp32", "bf16": "--precision=bf16", "fp16": "--precision=fp16"},
    "mixed_precision": {"fp32": "--mixed_precision=no", "bf16": "--mixed_precision=bf16",
                        "fp16": "--mixed_precision=fp16"},
    "amp": {"fp32": "no --amp", "bf16": "--amp", "fp16": "--amp"},
    "fp16": {"fp32": "no --fp16", "bf16": "no --fp16 (and --bf16 if it has one)", "fp16": "--fp16"},
    "bf16": {"fp32": "no --bf16", "bf16": "--bf16", "fp16": "no --bf16 (and --fp16 if it has one)"},
}


class PlainTorch(FrameworkAdapter):
    """A plain PyTorch loop: torch's own forward, backward, optimizer and GradScaler seams."""

    name = "torch"
    label = "the plain PyTorch loop"
    # No name means it: the registry chooses it for a script that imports no framework and no
    # advisor (``fallback``). The module is what a warm trial server imports first.
    detected_by = {"torch": ()}
    fallback = True
    precedence = 90
    autocasts = ("bf16", "fp16")
    half_weights = ("bf16", "fp16")
    # torchao's Float8Linear keeps each Linear's Parameter, so its swap at the model's first
    # forward leaves the script's optimizer holding the parameters it trains.
    fp8 = {"torchao": ("tensorwise", "rowwise", "rowwise_with_gw_hp")}
    loss_scale_kinds = ("dynamic", "static", "none")
    loss_scale_settings = True
    sets_grad_clip = False

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        """Put the candidate's hooks in place at torch's seams, before the script runs."""
        import torch
        import torch.amp.grad_scaler
        import torch.cpu.amp
        import torch.cuda.amp
        import torch.nn.parallel
        from torch.nn.modules import module
        from torch.optim import optimizer

        run = _Run(policy, recorder)
        hold_switches(policy, device)
        steps, precision = run.steps, run.precision
        scaler_class = candidate_scaler_class(torch.amp.GradScaler, policy=policy, steps=steps)
        for owner in (torch.amp, torch.amp.grad_scaler, torch.cuda.amp, torch.cpu.amp):
            owner.GradScaler = scaler_class
        for name in ("torch.cuda.amp.grad_scaler", "torch.cpu.amp.grad_scaler"):
            if name in sys.modules:
                sys.modules[name].GradScaler = scaler_class
        module.register_module_forward_pre_hook(precision.pre)
        module.register_module_forward_hook(precision.post, always_call=True)
        optimizer.register_optimizer_step_pre_hook(functools.partial(before_step, steps))
        optimizer.register_optimizer_step_post_hook(steps.optimizer_post)
        _wrap_optimizer_init(torch.optim.Optimizer, steps, precision)
        # Pure modes: DDP's gradient buckets take the parameters' dtype: cast before it builds them.
        wrap_once(torch.nn.parallel.DistributedDataParallel, "__init__",
                  around(lambda ddp, module, *args, **kwargs: precision.cast_module(module)))
        wrap_backward(torch.Tensor, steps)
        _wrap_clipping(steps)
        _announce(policy, recorder)
        if recorder is None:
            guard = run_guard(policy)
            if guard is not None:
                steps.watch = guard.step
        else:
            recorder.no_step_reason = run.no_backward
            recorder.policy_applied()  # the hooks are the candidate: the script's bound starts here
            shift_seed([torch, torch.random], "manual_seed", recorder)
            atexit.register(run.at_exit)
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signum, run.signalled)


@dataclass(frozen=True)
class PrecisionFlag:
    """The script's own precision flag: its name and the value it was given (``None``: its default)."""

    name: str
    given: str | None


def precision_flag(argv: Sequence[str], source: str) -> PrecisionFlag | None:
    """The precision flag a script takes, from its arguments, then its source: an
    ``add_argument("--dtype", ...)`` or a top-level ``dtype = ...`` a ``--key=value`` configurator
    overrides (pure)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        key = name.lstrip("-").replace("-", "_")
        if not name.startswith("--") or key not in PRECISION_FLAGS:
            continue
        if eq:
            return PrecisionFlag(key, value)
        following = argv[i + 1] if i + 1 < len(argv) else None
        takes_value = key in ("dtype", "precision", "mixed_precision")
        return PrecisionFlag(key, following if takes_value and following and not following.startswith("-") else "on")
    for key in PRECISION_FLAGS:
        spelled = "[-_]".join(key.split("_"))
        if re.search(rf"""add_argument\(\s*['"]--{spelled}['"]""", source) or re.search(
                rf"^{key}\s*=", source, flags=re.MULTILINE):
            return PrecisionFlag(key, None)
    return None


def flag_advice(flag: PrecisionFlag, mode: str) -> str:
    """What the script's flag should say for ``mode``, in one sentence (pure)."""
    facts = mode_facts(mode)
    family = facts.autocast or facts.weights
    value = _FLAG_VALUES[flag.name].get(family, "")
    given = f"given {flag.given}" if flag.given is not None else "left at its default"
    pure = " (the flag's value is a mixed mode; pure half weights have no flag value)" if facts.weights != "fp32" else ""
    return (f"the script's own precision flag --{flag.name} ({given}) was overruled; "
            f"for {mode} pass {value}{pure}")


class _Run:
    """What ``install`` holds for the life of the script: the hooks and how the run ends."""

    def __init__(self, policy: Policy, recorder: FrameworkRecorder | None) -> None:
        self.recorder = recorder
        self.steps = Steps(recorder, refuse=self.refuse, label=policy.mode)
        self.precision = ForwardPrecision(policy, self.steps)
        self.stopped = False

    def refuse(self, reason: str) -> None:
        """End the run: a trial as unsupported, a run with one error line."""
        if self.recorder is not None:
            self.recorder.writer.write(stage=Stage.UNSUPPORTED, reason=reason)
            end_trial_process(EXIT_UNSUPPORTED)
        sys.stderr.write(f"error: {reason}\n")
        sys.stderr.flush()
        os._exit(1)

    def no_backward(self) -> str:
        """The recorder's first-step watchdog expired: what the script reached."""
        what = f"the script reached no backward within {self.recorder.spec.first_step_timeout:g} s"
        return seen_line(self.steps.seen, what=what)

    def at_exit(self) -> None:
        """The script ended by itself before any backward: say so instead of a silent no-step."""
        if (self.recorder is None or self.steps.seen.backwards or self.stopped
                or self.recorder.writer.data.get("stage") not in (Stage.LOADED, None)):
            return
        line = seen_line(self.steps.seen, what="the script ended before any backward") + (
            "; a script that trains through advisor.load_policy() must import advisor")
        sys.stderr.write(f"mpadvise: {line}\n")
        self.recorder.writer.write(stage=Stage.NO_STEP, reason=line)

    def signalled(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        sys.stderr.write(f"mpadvise: {seen_line(self.steps.seen, what=f'the script was stopped by {name}')}\n")
        sys.stderr.flush()
        self.stopped = True
        if self.recorder is not None:
            end_trial_process(128 + signum)  # the parent, which sent it or got it too, decides
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # the script's own handling of Ctrl-C runs
        raise SystemExit(128 + signum)


def _announce(policy: Policy, recorder: FrameworkRecorder | None) -> None:
    """Name the script's own precision flag and what it should say for this policy."""
    # Under the boot, argv is [boot, framework, script, args...] until the script runs.
    argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == PlainTorch.name else sys.argv
    script, args = (argv[0], list(argv[1:])) if argv else ("", [])
    try:
        source = Path(script).read_text(encoding="utf-8")
    except OSError:
        source = ""
    flag = precision_flag(args, source)
    if flag is None:
        return
    advice = flag_advice(flag, policy.mode)
    if recorder is not None:
        recorder.note(advice)
    else:
        get_logger().info(advice)


def _wrap_optimizer_init(cls: type, steps: Steps, precision: ForwardPrecision) -> None:
    original = cls.__init__

    @functools.wraps(original)
    def __init__(optimizer: Any, params: Any, defaults: Any, *args: Any, **kwargs: Any) -> None:
        if hasattr(params, "dim"):
            params = [params]
        params = [dict(g, params=list(g["params"]) if not hasattr(g["params"], "dim") else [g["params"]])
                  if isinstance(g, dict) else g for g in params]
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        precision.cast_parameters(tensors)
        original(optimizer, params, defaults, *args, **kwargs)
        steps.optimizers.add(optimizer)
        steps.seen.optimizers += 1

    cls.__init__ = __init__


def _wrap_clipping(steps: Steps) -> None:
    import torch.nn.utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(clip_grad, name)

        def clip(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            before_clip(steps)
            return _original(*args, **kwargs)

        functools.update_wrapper(clip, original)
        setattr(torch.nn.utils, name, clip)
        setattr(clip_grad, name, clip)


class RunGuard:
    """Watches a script's optimizer steps (``setting``: warn or fallback); warns once, records."""

    def __init__(self, policy: Policy, setting: str) -> None:
        self.policy = policy
        self.guard = Guard(setting, GuardLimits.from_thresholds(StabilityThresholds()),
                           trend=guard_fallback(policy, probes.profile_for(None)) is not None)
        self.optimizer_steps = 0

    def step(self, loss: Any, scale: float | None, skipped: bool) -> None:
        """One optimizer step's facts: its loss (a tensor), the scale after it, a skip."""
        self.optimizer_steps += 1
        if self.optimizer_steps == 1 and self.guard.trend_on:
            # fp32's loss per optimizer step in the newest tune of this script with these
            # arguments, or nothing (by now the script runs, and argv is its own).
            from advisor.cache import cached_answers

            args, script = tuple(sys.argv[1:]), Path(sys.argv[0]).resolve()
            found = (answer.reference for answer in cached_answers(probes.profile_for(None), script)
                     if answer.args in (None, args))
            self.guard.reference = next(found, ())
            self.guard.trend.reference = list(self.guard.reference)
        if self.guard.tripped:
            return
        # float(loss): the loss value's one sync.
        tripped = self.guard.observe(self.optimizer_steps, loss=float(loss), applied=not skipped,
                                     loss_scale=scale)
        if tripped is not None:
            self._trip(*tripped)

    def _trip(self, signal: str, onset: int, detail: str) -> None:
        from advisor.cache import record_guard_event

        profile = probes.profile_for(None)
        target = guard_fallback(self.policy, profile)
        action = "restart needed" if target is not None else "warned"
        event = GuardEvent(signal, onset, self.optimizer_steps, self.policy.mode,
                           None if target is None else target.mode, action, detail)
        self.guard.record(event)
        get_logger().warning(event.line())
        # The script's cache entry keeps it: by now the script runs, and argv[0] is the script.
        script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
        record_guard_event(event.to_dict(), profile=profile, workload_fp=None, script=script)


def run_guard(policy: Policy) -> RunGuard | None:
    """The guard ``MPADVISE_GUARD`` asks for over this run (``mpadvise run`` sets it), or ``None``."""
    setting = guard_setting(None)
    return None if setting == "off" else RunGuard(policy, setting)


def watch_run(policy: Policy) -> None:
    """Under ``mpadvise run``, feed a framework script's optimizer steps to the guard
    ``MPADVISE_GUARD`` asks for (the plain adapter's ``install`` wires its own)."""
    guard = run_guard(policy)
    if guard is None:
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = Steps(None, refuse=lambda reason: None, label=policy.mode)
    steps.watch = guard.step
    register_optimizer_step_post_hook(steps.optimizer_post)
    wrap_backward(torch.Tensor, steps)
    # GradScaler's own scale and step, in place (every subclass's super() reaches them): the scaled
    # loss maps back to its value, and the step ends with its scale and skip.
    cls = torch.amp.GradScaler
    scale, step = cls.scale, cls.step
    cls.scale = lambda scaler, outputs: steps.scaled(scale(scaler, outputs), outputs)
    cls.step = lambda scaler, optimizer, *args, **kwargs: steps.scaler_step(
        scaler, optimizer, functools.partial(step, scaler, optimizer, *args, **kwargs))
