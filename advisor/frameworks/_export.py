"""``mpadvise export``: a Policy as a framework's own settings, faithful or refused (pure).

What each framework can apply comes from its ``FrameworkTraits`` and the adapters' own plans,
so an export is what a trial under that framework applied. Generated files are built as data
and written by the format's own writer, or as Python from fixed lines whose every value is a
``repr``: text from outside (the config path, the policy file) never becomes code. What the
policy leaves to the script (its batch, its clipping) stays the script's, with a note. A
bounded difference is a named warning (``ExportWarning``); anything more is ``ExportRefused``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, ClassVar

from advisor.frameworks._adapter import FrameworkTraits
from advisor.runtime import batch_split, tuned_global_batch
from policies import ModeFacts, Policy, default_reduce_dtype, mode_facts
from probes import MpadviseError, UsageError

DEVICES = ("cuda", "cpu")

FORMAT_OF_SUFFIX: Mapping[str, str] = {".py": "python", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}


class ExportRefused(MpadviseError):
    """The target cannot express the policy faithfully; the message says what and why (exit 1)."""


@dataclass(frozen=True)
class ExportWarning:
    """A bounded difference between the policy and what the target runs, with a stable ``id``."""

    id: str
    message: str


@dataclass(frozen=True)
class Export:
    """A policy in one target's own terms; ``alternates``: its other formats, or why one cannot carry it."""

    target: str
    text: str
    format: str
    data: Mapping[str, Any]
    warnings: tuple[ExportWarning, ...] = ()
    notes: tuple[str, ...] = ()
    alternates: Mapping[str, Export | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "format": self.format, "text": self.text, "settings": dict(self.data),
                "warnings": [dataclasses.asdict(w) for w in self.warnings], "notes": list(self.notes)}

    def for_file(self, path: str | PurePath) -> Export:
        """The export in the format ``path``'s extension names."""
        wanted = FORMAT_OF_SUFFIX.get(PurePath(path).suffix.lower())
        if wanted == self.format:
            return self
        alternate = self.alternates.get(wanted) if wanted is not None else None
        if isinstance(alternate, Export):
            return alternate
        if isinstance(alternate, str):
            raise ExportRefused(alternate)
        formats = [self.format, *self.alternates]
        named = "; ".join(f"{fmt} ({', '.join(s for s, f in FORMAT_OF_SUFFIX.items() if f == fmt)})"
                          for fmt in formats)
        raise UsageError(f"--out {path}: the {self.target} export is written as {named}; "
                         "give the file one of those extensions")


@dataclass(frozen=True)
class _Split:
    micro: int | None
    accum: int


@dataclass
class _Job:
    """One export being written, with the warnings and notes gathered."""

    policy: Policy
    target: str
    title: str
    device: str
    source: str | None
    warnings: list[ExportWarning] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def facts(self) -> ModeFacts:
        return mode_facts(self.policy.mode)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def refuse(self, reason: str) -> ExportRefused:
        return ExportRefused(f"cannot export {self.policy.describe()} to {self.target}: {reason}")

    def warn(self, warning_id: str, message: str) -> None:
        self.warnings.append(ExportWarning(warning_id, message))

    @functools.cached_property
    def split(self) -> _Split | None:
        """The batch the policy sets, or ``None`` where it keeps the script's. A micro-batch
        without ``grad_accum_steps`` needs the tuned global batch to know its accumulation."""
        policy = self.policy
        micro, accum = policy.micro_batch_size, policy.grad_accum_steps
        if micro is None and accum is None:
            return None
        if micro is not None and accum is None:
            tuned = tuned_global_batch(policy)
            if tuned is None:
                raise self.refuse(
                    f"the policy sets micro-batch {micro} without grad_accum_steps, so its accumulation "
                    "depends on the script's batch size; add grad_accum_steps to the config"
                )
            split = batch_split(policy, tuned)
            return _Split(split.micro, split.accum)
        return _Split(micro, accum or 1)

    def reduce_dtype_warning(self) -> None:
        """Warn where the policy reduces gradients in other than its mode's default under FSDP2."""
        policy = self.policy
        if policy.reduce_dtype is None or policy.reduce_dtype == default_reduce_dtype(policy.mode):
            return
        self.warn(
            "reduce-dtype-not-exported",
            f"the policy reduces gradients across ranks in {policy.reduce_dtype} under FSDP2, a setting of "
            "the sharding strategy that this export does not write: set it where the script shards the "
            "model (unsharded training ignores it)",
        )

    def tf32_lines(self, tf32: bool | None) -> list[str]:
        """The TF32 switches as ``policies``' fp32/tf32 modes set them (none for ``None``).

        torch >= 2.9 keeps them twice (the legacy API and ``fp32_precision``); both are set, legacy
        first: Lightning reads the legacy matmul precision, and the legacy ``cudnn.allow_tf32 =
        False`` alone leaves the new cuDNN switches inheriting, which can still mean TF32.
        """
        if tf32 is None:
            return []
        legacy, new = ("high", "tf32") if tf32 else ("highest", "ieee")
        what = "fp32 matmuls and cuDNN convolutions" if self.cuda else "fp32 matmuls"
        lines = [
            *_comment(f"{self.policy.mode}: TF32 {'on' if tf32 else 'off'} for {what}, as mpadvise sets it, "
                      "in both of torch's TF32 APIs."),
            f"torch.set_float32_matmul_precision({_py(legacy)})",
        ]
        if self.cuda:
            lines.append(f"torch.backends.cudnn.allow_tf32 = {_py(tf32)}")
        lines += [
            'if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9',
            f"    torch.backends.cuda.matmul.fp32_precision = {_py(new)}",
            f"    torch.backends.mkldnn.matmul.fp32_precision = {_py(new)}",
        ]
        if self.cuda:
            lines += [f"    torch.backends.cudnn.conv.fp32_precision = {_py(new)}",
                      f"    torch.backends.cudnn.rnn.fp32_precision = {_py(new)}"]
        return lines

    def dataloader_line(self, owner: str) -> list[str]:
        """The comment saying the DataLoader's batch size, where the policy sets a micro-batch."""
        if self.split is None or self.split.micro is None:
            return []
        per_step = f" ({self.split.accum} micro-batches per optimizer step)" if self.split.accum > 1 else ""
        return _comment(f"The DataLoader's batch_size must be {self.split.micro}, the policy's micro-batch: "
                        f"{owner} does not set it{per_step}.")

    def python(self, *blocks: list[str], data: Mapping[str, Any]) -> Export:
        """The Python export: first a string literal (not a comment, so that ``repr`` keeps any
        newline or quote of the source path inside it) naming the policy, its source and target."""
        where = "CUDA" if self.cuda else "a CPU"
        origin = f", from {self.source}" if self.source else ""
        header = f"mpadvise policy {self.policy.describe()}{origin}, for {self.title} on {where}."
        text = "\n".join(_code([repr(header)], *blocks)) + "\n"
        return Export(self.target, text, "python", data, tuple(self.warnings), tuple(self.notes))


def _code(*blocks: list[str]) -> list[str]:
    """Blocks of lines one blank line apart; two around a class or a function."""
    out: list[str] = []
    previous: list[str] = []
    for block in blocks:
        if not block:
            continue
        if out:
            out.append("")
            if any(b and b[0].startswith(("class ", "def ")) for b in (block, previous)):
                out.append("")
        out.extend(block)
        previous = block
    return out


class _Code(str):
    """Source code of the export's own (fixed text and ``_py`` literals), written as it is."""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=100, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def _py(value: Any) -> str:
    """A Python literal, by ``repr``: ``float("inf")`` for infinity; ``_Code`` as it is."""
    if isinstance(value, _Code):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return f"float({repr('inf') if value > 0 else repr('-inf')})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise TypeError(f"an export writes plain values only, not {type(value).__name__}")


def _call(name: str, kwargs: Mapping[str, Any], *, indent: str = "", args: tuple[Any, ...] = ()) -> list[str]:
    """``name(arg, ..., key=value, ...)``, one argument a line; ``name`` and keys are the export's own."""
    items = [_py(a) for a in args] + [f"{k}={_py(v)}" for k, v in kwargs.items()]
    return [f"{indent}{name}(", *(f"{indent}    {item}," for item in items), f"{indent})"]


class Exporter:
    """Writes a Policy in one target's (``--to``) own settings; a subclass defines ``write``."""

    target: ClassVar[str]
    title: ClassVar[str]
    script: Path | None = None  # the training script named to `mpadvise export`, if any
    # The batch split and clipping stay the script's (the export says how to set them).
    script_sets_batch: ClassVar[bool] = False

    def export(self, policy: Policy, *, traits: FrameworkTraits | None, device: str,
               source: str | None) -> Export:
        """``policy`` as this target's settings (``traits``: ``None`` for export-only targets)."""
        if device not in DEVICES:
            raise UsageError(f"unknown device {device!r} for an export; expected one of {', '.join(DEVICES)}")
        job = _Job(policy, self.target, self.title, device, source)
        if self.script_sets_batch:
            policy = policy.with_(micro_batch_size=None, grad_accum_steps=None, grad_clip_norm=None)
        reason = None if traits is None else traits.refusal(policy, device=device)
        if reason is not None:
            raise job.refuse(reason)
        return self.write(job)

    def write(self, job: _Job) -> Export:
        raise NotImplementedError(f"{type(self).__qualname__} does not say what it writes; define write(job)")
