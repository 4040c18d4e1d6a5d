"""Workload fingerprints: a short, stable key for "this model, this optimizer, this batch, this script".

A cached recommendation is keyed by (hardware fingerprint, workload fingerprint), so the
workload fingerprint must change whenever something that changes the precision answer
changes, and must not change for things that do not:

* Covered: the model's structure (every module's type name and qualified name, in order;
  every parameter's name, shape and ``requires_grad``), as its :func:`model_signature`; the
  optimizer class and its precision-relevant hyperparameters per parameter group; the number
  of processes training together (the world size: under torchrun each process trains on its
  own share of the batch, so two processes measure another step than one or eight); the global
  batch (the script's own batch per process times the world size: how a policy splits it is
  the answer, not the workload); the script's file name, a digest of its content, and its
  command-line arguments.
* Not covered: parameter values (training changes them), dtypes and devices (applying the
  precision policy itself converts them, and the key must be computed the same way before and
  after), buffers (their shapes follow from the module type and parameters), optimizer
  implementation switches such as ``foreach``/``fused``/``capturable`` (same maths), and the
  script's directory: the cache finds entries by the script's exact path, so the key need not
  repeat it, and a copy of the same project keys the same.
* Module types are recorded by class ``__qualname__`` without the Python module path, so a
  model class defined in a script gives the same key whether the script runs as ``__main__``
  or is imported.
* One process keys without a world size line, exactly as before the world size was recorded,
  so a cache entry written then reads as one process.
* Editing the script (even a comment) or running it with other arguments makes the cache
  miss, which is the safe direction: a silent hit on changed code could apply a policy that
  was never measured for it.

Everything is hashed with SHA-256 over a canonical text (never ``hash()`` or ``id()``), so the
key is identical across processes, machines and Python runs. Only attribute access on the
model and optimizer is needed; torch is not imported here.

:func:`workload_mismatch` says what changed since a policy was tuned, as data that is
formatted only where a person reads it. A tune records the model signature, the global batch
(per process) and the script's digest beside the fingerprint; the optimizer's settings and the
arguments are inside the fingerprint only, so whether they changed is decided by recomputing
the fingerprint with every recorded fact put back to its tuned value. The world size, where
``[tuned_on]`` does not record it, is recovered the same way: it is the one that, with every
recorded fact put back, gives the tuned fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from policies import Difference

if TYPE_CHECKING:
    from policies import TunedOn

# Bumped whenever the canonical text changes, so old keys miss rather than collide.
_FORMAT = "mpadvise-workload-v2"

FINGERPRINT_LENGTH = 16

# The largest world size tried when recovering the one a tune ran at from its fingerprint
# (hashing this many short texts takes milliseconds, and only when a fingerprint differs).
_MAX_RECOVERED_WORLD_SIZE = 1024

# Hyperparameters that change the arithmetic an optimizer does, and hence how it behaves under
# reduced precision (eps underflows in fp16, small lr * update vanishes in bf16...). An allow
# list rather than "everything in param_groups": LR schedulers add keys such as initial_lr,
# and libraries add implementation switches (foreach, fused, capturable, differentiable) that
# must not change the key.
OPTIMIZER_HYPERPARAMETERS: tuple[str, ...] = (
    "lr",
    "eps",
    "betas",
    "weight_decay",
    "momentum",
    "dampening",
    "nesterov",
    "amsgrad",
    "alpha",
    "centered",
)

# The facts a Difference may name, and how a log line says that a digest-only fact changed.
MODEL = "model structure"
GLOBAL_BATCH = "global batch"
WORLD_SIZE = "world size"
SCRIPT = "script"
SCRIPT_CONTENT = "script content"
_DIGEST_FACTS = {MODEL: "model structure differs", SCRIPT_CONTENT: "script edited"}


@dataclass(frozen=True)
class Workload:
    """The facts a workload fingerprint covers, as plain data.

    Attributes:
        model: the model's :func:`model_signature`.
        optimizer: the optimizer's class name, or ``None`` when there is none.
        groups: per parameter group, ``(name, canonical value)`` pairs: the parameter count,
            then the precision-relevant hyperparameters the group has.
        global_batch: samples per optimizer step over all processes (the script's batch per
            process times ``world_size``), or ``None`` when unknown.
        script: the script's file name, or ``None`` for in-process use (notebooks).
        script_digest: :func:`script_digest` of its content, or ``None`` when it is not a
            readable file.
        args: its command-line arguments.
        world_size: how many processes train together (1 for a single process).
    """

    model: str
    optimizer: str | None
    groups: tuple[tuple[tuple[str, str], ...], ...]
    global_batch: int | None
    script: str | None
    script_digest: str | None
    args: tuple[str, ...] = ()
    world_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Workload.world_size: {self.world_size!r} is not a process count; expected an integer >= 1")

    @classmethod
    def of(
        cls,
        model: Any,
        optimizer: Any | None,
        *,
        global_batch: int | None,
        script: str | os.PathLike[str] | None,
        args: Sequence[str] = (),
        world_size: int | None = None,
    ) -> Workload:
        """Read the facts from a model, an optimizer and the script (arguments as for
        :func:`workload_fingerprint`; ``world_size`` ``None`` reads :func:`current_world_size`)."""
        path = None if script is None else os.fspath(script)
        return cls(
            model=model_signature(model),
            optimizer=None if optimizer is None else type(optimizer).__qualname__,
            groups=_optimizer_groups(optimizer),
            global_batch=global_batch,
            script=None if path is None else os.path.basename(path),
            script_digest=None if path is None else script_digest(path),
            args=tuple(str(arg) for arg in args),
            world_size=current_world_size() if world_size is None else world_size,
        )

    def fingerprint(self) -> str:
        """16 lowercase hex characters: the cache key of this workload."""
        return _digest(self._head() + self._tail(self.world_size, self.global_batch))

    def _head(self) -> list[str]:
        """The canonical text's lines before the world size: model and optimizer."""
        lines = [_FORMAT, f"model {self.model}", f"optimizer {self.optimizer}"]
        for index, group in enumerate(self.groups):
            lines.append(f"group {index} " + " ".join(f"{key}={value}" for key, value in group))
        return lines

    def _tail(self, world_size: int, global_batch: int | None) -> list[str]:
        """The canonical text's lines from the world size on, at ``world_size`` and ``global_batch``."""
        # Absent for one process, so that keys from before the world size was recorded still hit.
        lines = [] if world_size == 1 else [f"world_size {world_size}"]
        lines.append(f"global_batch {_canonical(global_batch)}")
        lines.append(f"script {self.script} {self.script_digest or 'missing'}")
        lines.append(f"args {json.dumps(list(self.args))}")
        return lines

    def describe_optimizer(self) -> str:
        """``"AdamW(lr=0.001, eps=1e-08, betas=(0.9,0.999), weight_decay=0.01)"``, for people."""
        if self.optimizer is None:
            return "no optimizer"
        if not self.groups:
            return self.optimizer
        first = ", ".join(f"{key}={value}" for key, value in self.groups[0] if key != "params")
        more = f" and {len(self.groups) - 1} more parameter groups" if len(self.groups) > 1 else ""
        return f"{self.optimizer}({first}){more}"


@dataclass(frozen=True)
class WorkloadMismatch:
    """Why a tuned policy does not fit this run's workload: what changed since tuning.

    Attributes:
        differences: the recorded facts that changed (``what`` is :data:`MODEL`,
            :data:`WORLD_SIZE`, :data:`GLOBAL_BATCH`, :data:`SCRIPT` or
            :data:`SCRIPT_CONTENT`).
        unrecorded: when facts that the tune did not record (the optimizer's settings, the
            arguments...) differ too, their names; empty when they match.
        optimizer_now: this run's optimizer, for people (see ``Workload.describe_optimizer``).
        args_now: this run's arguments.
        world_size_now: this run's world size.
    """

    differences: tuple[Difference, ...]
    unrecorded: tuple[str, ...] = ()
    optimizer_now: str = ""
    args_now: tuple[str, ...] = ()
    world_size_now: int = 1

    def detail(self) -> str:
        """``"script edited; optimizer settings or script arguments differ (now AdamW(lr=0.001))"``."""
        parts = [_DIGEST_FACTS.get(d.what) or d.describe() for d in self.differences]
        if self.unrecorded:
            args = shlex.join(self.args_now) if self.args_now else "none"
            processes = f"; {self.world_size_now} processes" if WORLD_SIZE in self.unrecorded else ""
            parts.append(f"{_alternatives(self.unrecorded)} differ (now {self.optimizer_now}{processes}; arguments: {args})")
        return "; ".join(parts)

    def reason(self) -> str:
        """``"workload changed since tuning (global batch 64 -> 128)"``, to start a log line."""
        if not self.unrecorded and [d.what for d in self.differences] == [MODEL]:
            return "model changed since tuning (its structure differs from what was tuned)"
        return f"workload changed since tuning ({self.detail()})"

    def to_dict(self) -> dict[str, object]:
        return {
            "differences": [d.to_dict() for d in self.differences],
            "unrecorded": list(self.unrecorded),
            "optimizer_now": self.optimizer_now,
            "args_now": list(self.args_now),
            "world_size_now": self.world_size_now,
        }


def model_signature(model: Any) -> str:
    """A fingerprint of the model's structure alone, for "has the model changed since tuning?".

    Args:
        model: a ``torch.nn.Module`` (anything with ``named_modules()`` and
            ``named_parameters()``).

    Returns:
        16 lowercase hex characters.
    """
    return _digest(_model_lines(model))


def workload_fingerprint(
    model: Any,
    optimizer: Any | None,
    *,
    global_batch: int | None,
    script: str | os.PathLike[str] | None,
    args: Sequence[str] = (),
    world_size: int | None = None,
) -> str:
    """The cache key of a training workload: model structure, optimizer, processes, global batch,
    script.

    Args:
        model: a ``torch.nn.Module``.
        optimizer: a ``torch.optim.Optimizer`` (anything with ``param_groups``), or ``None``
            when there is none yet.
        global_batch: samples per optimizer step over all processes, or ``None`` when unknown.
        script: path of the training script, or ``None`` for in-process use (notebooks).
        args: the script's command-line arguments.
        world_size: how many processes train together; ``None`` reads
            :func:`current_world_size`.

    Returns:
        16 lowercase hex characters.
    """
    return Workload.of(
        model, optimizer, global_batch=global_batch, script=script, args=args, world_size=world_size
    ).fingerprint()


def current_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many processes train together: the initialised process group's size, else
    ``WORLD_SIZE`` (torchrun sets it in every process it starts), else 1.

    Args:
        env: the process environment; ``None`` for ``os.environ``.

    Returns:
        An integer >= 1; a ``WORLD_SIZE`` that is not a positive integer counts as one process.
    """
    # Not imported here: a script that never imported torch.distributed has no group.
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    text = (os.environ if env is None else env).get("WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else 1


def script_digest(path: str | os.PathLike[str]) -> str | None:
    """The first 16 hex digits of the SHA-256 of a script's bytes, or ``None`` when unreadable.

    Args:
        path: the script.

    Returns:
        The digest; ``None`` for a path that is not a readable file (a module name, a script
        on another machine), which then keys by its name alone.
    """
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()[:FINGERPRINT_LENGTH]
    except OSError:
        return None


def workload_mismatch(tuned: TunedOn, here: Workload, *, model_only: bool = False) -> WorkloadMismatch | None:
    """What changed between the workload a policy was tuned on and ``here``.

    Args:
        tuned: the policy's ``[tuned_on]`` record.
        here: this run's workload, with the global batch it trains at (or the tuned one per
            process times this run's world size, when the script has not said yet and the
            caller checks it later).
        model_only: compare the model's structure alone (a config file the user keeps
            beside the script), not the whole workload (a cached answer).

    Returns:
        ``None`` when the policy fits; otherwise the recorded facts that differ and, when the
        facts the tune did not record differ too, their names.
    """
    differences = []
    if tuned.model_signature and tuned.model_signature != here.model:
        differences.append(Difference(MODEL, tuned.model_signature, here.model))
    if model_only or not tuned.workload_fingerprint:
        return WorkloadMismatch(tuple(differences)) if differences else None
    if tuned.workload_fingerprint == here.fingerprint():
        return None
    recorded, unrecorded = _as_recorded(tuned, here)
    for what, tuned_value, here_value in (
        (WORLD_SIZE, recorded.world_size, here.world_size),
        (GLOBAL_BATCH, recorded.global_batch, here.global_batch),
        (SCRIPT, recorded.script, here.script),
        (SCRIPT_CONTENT, recorded.script_digest, here.script_digest),
    ):
        if tuned_value != here_value:
            differences.append(Difference(what, _text(tuned_value), _text(here_value)))
    if recorded.fingerprint() == tuned.workload_fingerprint:
        unrecorded = ()  # the recorded differences explain the whole change
    return WorkloadMismatch(tuple(differences), unrecorded, here.describe_optimizer(), here.args, here.world_size)


def _as_recorded(tuned: TunedOn, here: Workload) -> tuple[Workload, tuple[str, ...]]:
    """``here`` with every fact the tune recorded put back to its tuned value, and the names of
    the facts it did not record.

    ``[tuned_on]``'s global batch is the script's batch per process, as the tune saw it; the
    workload's is that times the world size. A world size the tune did not record is the one
    that reproduces the tuned fingerprint, when one does.
    """
    unrecorded = ["optimizer settings"]
    model = tuned.model_signature or here.model
    if not tuned.model_signature:
        unrecorded.append(MODEL)
    script = os.path.basename(tuned.script) if tuned.script else here.script
    digest = tuned.script_digest or here.script_digest
    if not tuned.script_digest:
        unrecorded.append(SCRIPT_CONTENT)
    unrecorded.append("script arguments")
    recorded = replace(here, model=model, script=script, script_digest=digest)
    per_process = tuned.global_batch

    def at(world_size: int) -> Workload:
        if per_process is None:
            return replace(recorded, world_size=world_size)
        return replace(recorded, world_size=world_size, global_batch=per_process * world_size)

    world_size = getattr(tuned, "world_size", None)  # a [tuned_on] that records it
    if world_size is None:
        world_size = _recovered_world_size(recorded, per_process, tuned.workload_fingerprint)
    if world_size is None:
        # Unknown, since other facts changed too. Most tunes and every entry from before the
        # world size was recorded ran one process: only a run of several names it.
        if here.world_size != 1:
            unrecorded.insert(1, WORLD_SIZE)
        world_size = here.world_size
    if per_process is None:
        unrecorded.insert(1, GLOBAL_BATCH)
    return at(world_size), tuple(unrecorded)


def _recovered_world_size(recorded: Workload, per_process: int | None, fingerprint: str | None) -> int | None:
    """The world size at which ``recorded`` (its global batch ``per_process`` times the world
    size, when known) has ``fingerprint``; ``None`` when none up to the largest tried does.

    The text before the world size is hashed once and its hash state copied for each world size
    tried, so that trying thousands takes milliseconds.
    """
    if not fingerprint:
        return None
    head = hashlib.sha256(("\n".join(recorded._head()) + "\n").encode("utf-8"))
    # The lines after the global batch do not depend on the world size.
    rest = "\n" + "\n".join(recorded._tail(1, None)[1:])
    for size in range(1, _MAX_RECOVERED_WORLD_SIZE + 1):
        batch = recorded.global_batch if per_process is None else per_process * size
        world = "" if size == 1 else f"world_size {size}\n"
        digest = head.copy()
        digest.update(f"{world}global_batch {_canonical(batch)}{rest}".encode())
        if digest.hexdigest()[:FINGERPRINT_LENGTH] == fingerprint:
            return size
    return None


def _alternatives(names: Sequence[str]) -> str:
    """``"a or b"``, ``"a, b or c"``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _digest(lines: Iterable[str]) -> str:
    text = "\n".join(lines).encode("utf-8")
    return hashlib.sha256(text).hexdigest()[:FINGERPRINT_LENGTH]


def _model_lines(model: Any) -> list[str]:
    lines = []
    for name, module in model.named_modules():
        lines.append(f"module {name or '.'} {type(module).__qualname__}")
    for name, parameter in model.named_parameters():
        shape = "x".join(str(int(size)) for size in parameter.shape)
        lines.append(f"param {name} [{shape}] grad={bool(parameter.requires_grad)}")
    return lines


def _optimizer_groups(optimizer: Any | None) -> tuple[tuple[tuple[str, str], ...], ...]:
    if optimizer is None:
        return ()
    groups = []
    for group in getattr(optimizer, "param_groups", ()):
        settings = [("params", str(len(group.get("params", ()))))]
        settings += [(key, _canonical(group[key])) for key in OPTIMIZER_HYPERPARAMETERS if key in group]
        groups.append(tuple(settings))
    return tuple(groups)


def _canonical(value: Any) -> str:
    """Text for a hyperparameter that is the same for equal values in every process."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_canonical(item) for item in value) + ")"
    if hasattr(value, "item"):
        # A tensor hyperparameter (capturable/compiled optimizers keep lr as a tensor).
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # momentum=0 and momentum=0.0 are the same optimizer; repr() of a float is the
        # shortest round-tripping text, identical in every process.
        return repr(float(value))
    return f"{type(value).__qualname__}:{value!r}"
