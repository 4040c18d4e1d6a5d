"""Workload fingerprints: a short, stable key for "this model, this optimizer, this batch, this script".

A cached recommendation is keyed by (hardware fingerprint, workload fingerprint), so the
workload fingerprint must change whenever something that changes the precision answer
changes, and must not change for things that do not:

* Covered: every module's type name and qualified name, in order; every parameter's name,
  shape and ``requires_grad``; the optimizer class and its precision-relevant hyperparameters
  per parameter group; the global batch; the script's file name and a hash of its content.
* Not covered: parameter values (training changes them), dtypes and devices (applying the
  precision policy itself converts them, and the key must be computed the same way before and
  after), buffers (their shapes follow from the module type and parameters), and optimizer
  implementation switches such as ``foreach``/``fused``/``capturable`` (same maths).
* Module types are recorded by class ``__qualname__`` without the Python module path, so a
  model class defined in a script gives the same key whether the script runs as ``__main__``
  or is imported.
* The script contributes its base name plus a SHA-256 of its bytes when the file exists:
  editing the script (even a comment) makes the cache miss, which is the safe direction, since
  a silent hit on changed code could apply a policy that was never measured for it. Moving
  the script to another directory keeps the key.

Everything is hashed with SHA-256 over a canonical text (never ``hash()`` or ``id()``), so the
key is identical across processes, machines and Python runs. Only attribute access on the
model and optimizer is needed; torch is not imported here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

# Bumped whenever the canonical text changes, so old keys miss rather than collide.
_FORMAT = "mpadvise-workload-v1"

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
) -> str:
    """The cache key of a training workload: model structure, optimizer, global batch, script.

    Args:
        model: a ``torch.nn.Module``.
        optimizer: a ``torch.optim.Optimizer`` (anything with ``param_groups``), or ``None``
            when there is none yet.
        global_batch: samples per optimizer step, or ``None`` when unknown.
        script: path of the training script, or ``None`` for in-process use (notebooks).

    Returns:
        16 lowercase hex characters.
    """
    lines = [_FORMAT]
    lines.extend(_model_lines(model))
    lines.extend(_optimizer_lines(optimizer))
    lines.append(f"global_batch {_canonical(global_batch)}")
    lines.append(_script_line(script))
    return _digest(lines)


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


def _optimizer_lines(optimizer: Any | None) -> list[str]:
    if optimizer is None:
        return ["optimizer none"]
    lines = [f"optimizer {type(optimizer).__qualname__}"]
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        settings = " ".join(
            f"{key}={_canonical(group[key])}" for key in OPTIMIZER_HYPERPARAMETERS if key in group
        )
        lines.append(f"group {index} params={len(group.get('params', ()))} {settings}")
    return lines


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


def _script_line(script: str | os.PathLike[str] | None) -> str:
    if script is None:
        return "script none"
    path = os.fspath(script)
    name = os.path.basename(path)
    try:
        with open(path, "rb") as handle:
            content = hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        # Not a readable file (a module name, or a script on another machine): the name alone.
        content = "missing"
    return f"script {name} {content}"
