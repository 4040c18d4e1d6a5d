"""Workload fingerprints: a short, stable key for "this model, this optimizer, this batch, this script".

A cached recommendation is keyed by (hardware fingerprint, workload fingerprint), so the
workload fingerprint must change whenever something that changes the precision answer
changes, and must not change for things that do not:

* Covered: the model's structure (every module's type name and qualified name, in order;
  every parameter's name, shape and ``requires_grad``), as its :func:`model_signature`; the
  optimizer class and its precision-relevant hyperparameters per parameter group; the global
  batch (the script's own batch: how a policy splits it is the answer, not the workload); the
  script's file name, a digest of its content, and its command-line arguments.
* Not covered: parameter values (training changes them), dtypes and devices (applying the
  precision policy itself converts them, and the key must be computed the same way before and
  after), buffers (their shapes follow from the module type and parameters), optimizer
  implementation switches such as ``foreach``/``fused``/``capturable`` (same maths), and the
  script's directory: the cache finds entries by the script's exact path, so the key need not
  repeat it, and a copy of the same project keys the same.
* Module types are recorded by class ``__qualname__`` without the Python module path, so a
  model class defined in a script gives the same key whether the script runs as ``__main__``
  or is imported.
* Editing the script (even a comment) or running it with other arguments makes the cache
  miss, which is the safe direction: a silent hit on changed code could apply a policy that
  was never measured for it.

Everything is hashed with SHA-256 over a canonical text (never ``hash()`` or ``id()``), so the
key is identical across processes, machines and Python runs. Only attribute access on the
model and optimizer is needed; torch is not imported here.

:func:`workload_mismatch` says what changed since a policy was tuned, as data that is
formatted only where a person reads it. A tune records the model signature, the global batch
and the script's digest beside the fingerprint; the optimizer's settings and the arguments are
inside the fingerprint only, so whether they changed is decided by recomputing the
fingerprint with every recorded fact put back to its tuned value.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from policies import Difference

if TYPE_CHECKING:
    from policies import TunedOn

# Bumped whenever the canonical text changes, so old keys miss rather than collide.
_FORMAT = "mpadvise-workload-v2"

FINGERPRINT_LENGTH = 16

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
        global_batch: samples per optimizer step as the script asks for them, or ``None``
            when unknown.
        script: the script's file name, or ``None`` for in-process use (notebooks).
        script_digest: :func:`script_digest` of its content, or ``None`` when it is not a
            readable file.
        args: its command-line arguments.
    """

    model: str
    optimizer: str | None
    groups: tuple[tuple[tuple[str, str], ...], ...]
    global_batch: int | None
    script: str | None
    script_digest: str | None
    args: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        model: Any,
        optimizer: Any | None,
        *,
        global_batch: int | None,
        script: str | os.PathLike[str] | None,
        args: Sequence[str] = (),
    ) -> Workload:
        """Read the facts from a model, an optimizer and the script (arguments as for
        :func:`workload_fingerprint`)."""
        path = None if script is None else os.fspath(script)
        return cls(
            model=model_signature(model),
            optimizer=None if optimizer is None else type(optimizer).__qualname__,
            groups=_optimizer_groups(optimizer),
            global_batch=global_batch,
            script=None if path is None else os.path.basename(path),
            script_digest=None if path is None else script_digest(path),
            args=tuple(str(arg) for arg in args),
        )

    def fingerprint(self) -> str:
        """16 lowercase hex characters: the cache key of this workload."""
        lines = [_FORMAT, f"model {self.model}", f"optimizer {self.optimizer}"]
        for index, group in enumerate(self.groups):
            lines.append(f"group {index} " + " ".join(f"{key}={value}" for key, value in group))
        lines.append(f"global_batch {_canonical(self.global_batch)}")
        lines.append(f"script {self.script} {self.script_digest or 'missing'}")
        lines.append(f"args {json.dumps(list(self.args))}")
        return _digest(lines)

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
            :data:`GLOBAL_BATCH`, :data:`SCRIPT` or :data:`SCRIPT_CONTENT`).
        unrecorded: when facts that the tune did not record (the optimizer's settings, the
            arguments...) differ too, their names; empty when they match.
        optimizer_now: this run's optimizer, for people (see ``Workload.describe_optimizer``).
        args_now: this run's arguments.
    """

    differences: tuple[Difference, ...]
    unrecorded: tuple[str, ...] = ()
    optimizer_now: str = ""
    args_now: tuple[str, ...] = ()

    def detail(self) -> str:
        """``"script edited; optimizer settings or script arguments differ (now AdamW(lr=0.001))"``."""
        parts = [_DIGEST_FACTS.get(d.what) or d.describe() for d in self.differences]
        if self.unrecorded:
            args = shlex.join(self.args_now) if self.args_now else "none"
            parts.append(f"{_alternatives(self.unrecorded)} differ (now {self.optimizer_now}; arguments: {args})")
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
) -> str:
    """The cache key of a training workload: model structure, optimizer, global batch, script.

    Args:
        model: a ``torch.nn.Module``.
        optimizer: a ``torch.optim.Optimizer`` (anything with ``param_groups``), or ``None``
            when there is none yet.
        global_batch: samples per optimizer step as the script asks for them, or ``None``
            when unknown.
        script: path of the training script, or ``None`` for in-process use (notebooks).
        args: the script's command-line arguments.

    Returns:
        16 lowercase hex characters.
    """
    return Workload.of(model, optimizer, global_batch=global_batch, script=script, args=args).fingerprint()


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
        here: this run's workload, with the global batch it trains at (or the tuned one, when
            the script has not said yet and the caller checks it later).
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
        (GLOBAL_BATCH, recorded.global_batch, here.global_batch),
        (SCRIPT, recorded.script, here.script),
        (SCRIPT_CONTENT, recorded.script_digest, here.script_digest),
    ):
        if tuned_value != here_value:
            differences.append(Difference(what, _text(tuned_value), _text(here_value)))
    if recorded.fingerprint() == tuned.workload_fingerprint:
        unrecorded = ()  # the recorded differences explain the whole change
    return WorkloadMismatch(tuple(differences), unrecorded, here.describe_optimizer(), here.args)


def _as_recorded(tuned: TunedOn, here: Workload) -> tuple[Workload, tuple[str, ...]]:
    """``here`` with every fact the tune recorded put back to its tuned value, and the names of
    the facts it did not record."""
    unrecorded = ["optimizer settings"]
    model = tuned.model_signature or here.model
    if not tuned.model_signature:
        unrecorded.append(MODEL)
    batch = tuned.global_batch if tuned.global_batch is not None else here.global_batch
    if tuned.global_batch is None:
        unrecorded.append(GLOBAL_BATCH)
    script = os.path.basename(tuned.script) if tuned.script else here.script
    digest = tuned.script_digest or here.script_digest
    if not tuned.script_digest:
        unrecorded.append(SCRIPT_CONTENT)
    unrecorded.append("script arguments")
    recorded = replace(here, model=model, global_batch=batch, script=script, script_digest=digest)
    return recorded, tuple(unrecorded)


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
