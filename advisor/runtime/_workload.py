"""Workload fingerprints (docs/cache.md, "What a cached answer is keyed by"): SHA-256 over a
canonical text, identical across processes and machines; torch is not imported here. They ignore
parameter values, dtypes and devices (applying the policy converts them), buffers, ``foreach``/
``fused`` switches and the script's directory; an edited script misses the cache, the safe way."""
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

# The largest world size tried when recovering the one a tune ran at from its fingerprint.
_MAX_RECOVERED_WORLD_SIZE = 1024

# An allow list rather than "everything in param_groups": LR schedulers add keys such as
# initial_lr, and libraries add switches (foreach, fused, capturable) that must not change the key.
OPTIMIZER_HYPERPARAMETERS: tuple[str, ...] = (
    "lr", "eps", "betas", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "alpha", "centered",
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
    """The facts a workload fingerprint covers; ``groups``: per parameter group, ``(name,
    canonical value)`` pairs (the parameter count, then the hyperparameters)."""

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
    def of(cls, model: Any, optimizer: Any | None, *, global_batch: int | None,
           script: str | os.PathLike[str] | None, args: Sequence[str] = (), world_size: int | None = None) -> Workload:
        """The facts of a model, an optimizer and the script (``global_batch``: all processes')."""
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
        groups = [f"group {index} " + " ".join(f"{key}={value}" for key, value in group)
                  for index, group in enumerate(self.groups)]
        return [_FORMAT, f"model {self.model}", f"optimizer {self.optimizer}", *groups]

    def _tail(self, world_size: int, global_batch: int | None) -> list[str]:
        # Absent for one process, so that keys from before the world size was recorded still hit.
        world = [] if world_size == 1 else [f"world_size {world_size}"]
        return [*world, f"global_batch {_canonical(global_batch)}",
                f"script {self.script} {self.script_digest or 'missing'}",
                f"args {json.dumps(list(self.args))}"]

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
    """What changed since tuning: the recorded ``differences``, and the names of facts the tune
    did not record that differ too (``unrecorded``), with this run's values of those."""

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
            names = self.unrecorded
            either = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            parts.append(f"{either} differ (now {self.optimizer_now}{processes}; arguments: {args})")
        return "; ".join(parts)

    def reason(self) -> str:
        """``"workload changed since tuning (global batch 64 -> 128)"``, to start a log line."""
        if not self.unrecorded and [d.what for d in self.differences] == [MODEL]:
            return "model changed since tuning (its structure differs from what was tuned)"
        return f"workload changed since tuning ({self.detail()})"


def model_signature(model: Any) -> str:
    """16 hex characters fingerprinting the model's structure alone. Module types go by
    ``__qualname__``, so a model class in a script keys the same as ``__main__`` or imported."""
    lines = [f"module {name or '.'} {type(module).__qualname__}" for name, module in model.named_modules()]
    for name, parameter in model.named_parameters():
        shape = "x".join(str(int(size)) for size in parameter.shape)
        lines.append(f"param {name} [{shape}] grad={bool(parameter.requires_grad)}")
    return _digest(lines)


def current_world_size(env: Mapping[str, str] | None = None) -> int:
    """The initialised process group's size, else ``WORLD_SIZE`` if a positive integer, else 1."""
    # Not imported here: a script that never imported torch.distributed has no group.
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    text = (os.environ if env is None else env).get("WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else 1


def script_digest(path: str | os.PathLike[str]) -> str | None:
    """The first 16 hex digits of the SHA-256 of a script's bytes, or ``None`` when unreadable
    (a module name, a script on another machine: it then keys by its name alone)."""
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()[:FINGERPRINT_LENGTH]
    except OSError:
        return None


def workload_mismatch(tuned: TunedOn, here: Workload, *, model_only: bool = False) -> WorkloadMismatch | None:
    """What changed between the workload a policy was tuned on and ``here``; ``None`` when it fits.
    Facts the tune did not record are judged by the fingerprint with the recorded ones put back."""
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
            texts = (None if v is None else str(v) for v in (tuned_value, here_value))
            differences.append(Difference(what, *texts))
    if recorded.fingerprint() == tuned.workload_fingerprint:
        unrecorded = ()  # the recorded differences explain the whole change
    return WorkloadMismatch(tuple(differences), unrecorded, here.describe_optimizer(), here.args, here.world_size)


def _as_recorded(tuned: TunedOn, here: Workload) -> tuple[Workload, tuple[str, ...]]:
    """``here`` with every recorded fact put back to its tuned value, and the facts not recorded."""
    unrecorded = ["optimizer settings"]
    if not tuned.model_signature:
        unrecorded.append(MODEL)
    if not tuned.script_digest:
        unrecorded.append(SCRIPT_CONTENT)
    unrecorded.append("script arguments")
    recorded = replace(here, model=tuned.model_signature or here.model,
                       script=os.path.basename(tuned.script) if tuned.script else here.script,
                       script_digest=tuned.script_digest or here.script_digest)
    per_process = tuned.global_batch
    world_size = _recovered_world_size(recorded, per_process, tuned.workload_fingerprint)
    if world_size is None:
        # Unknown, since other facts changed too. Most tunes and every entry from before the
        # world size was recorded ran one process: only a run of several names it.
        if here.world_size != 1:
            unrecorded.insert(1, WORLD_SIZE)
        world_size = here.world_size
    if per_process is None:
        unrecorded.insert(1, GLOBAL_BATCH)
    batch = recorded.global_batch if per_process is None else per_process * world_size
    return replace(recorded, world_size=world_size, global_batch=batch), tuple(unrecorded)


def _recovered_world_size(recorded: Workload, per_process: int | None, fingerprint: str | None) -> int | None:
    """The world size at which ``recorded`` has ``fingerprint``, or ``None``. The text before
    the world size is hashed once and its state copied per size, so trying 1024 takes milliseconds."""
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


def _digest(lines: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:FINGERPRINT_LENGTH]


def _optimizer_groups(optimizer: Any | None) -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple((("params", str(len(group.get("params", ())))),
                  *((key, _canonical(group[key])) for key in OPTIMIZER_HYPERPARAMETERS if key in group))
                 for group in getattr(optimizer, "param_groups", ()))


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
        # momentum=0 and momentum=0.0 are the same optimizer.
        return repr(float(value))
    return f"{type(value).__qualname__}:{value!r}"
