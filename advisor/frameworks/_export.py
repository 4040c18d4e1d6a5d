"""``mpadvise export``: a Policy as a framework's own settings, faithful or refused (pure).

Each target gets the settings it reads: the Lightning Trainer and Fabric a precision string or
plugin code, the Hugging Face Trainer ``TrainingArguments`` fields, Accelerate code with its
kwargs handlers or its YAML config file, DeepSpeed its JSON config, torchtitan a function over
its Python config (``Trainer.Config``, torchtitan 0.3). For the four frameworks whose scripts
mpadvise also tunes (Lightning, Fabric, the HF Trainer, Accelerate), what each can apply comes
from its ``FrameworkTraits`` and what each mode becomes from the adapters' own plans
(``lightning_precision``, ``accelerate_settings``), so the export of a policy is what a trial
under that framework applied. DeepSpeed and torchtitan read the mode's facts (``mode_facts``).

Generated files are data, serialized: each writer builds the settings as plain data and renders
them with the format's own writer (``json.dumps``, ``yaml.safe_dump``), or, for Python, through
fixed lines whose every value is a ``repr``. Text from outside (the config path, anything in
the policy file) never becomes code: the header that names the source is a string literal.

What the policy leaves to the script stays the script's: a policy that keeps the script's
batch writes no batch size or accumulation, and one that does not clip writes no clipping
(every trial clipped as the script does); a note says so.

An export is faithful, or refused with the reason (``ExportRefused``, one line). Where a target
differs from the policy by a bounded amount, the export says so with a named warning: a stable
id and a sentence (``ExportWarning``).

This module holds what every target shares: the ``Export`` value, the ``Exporter`` base, the
job an exporter writes (``_Job``) and the code writers. Each target family is one module of its
own: ``_export_lightning`` (the Trainer and Fabric), ``_export_transformers``,
``_export_accelerate``, ``_export_deepspeed`` and ``_export_torchtitan``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar

from advisor.frameworks._traits import FrameworkTraits
from advisor.runtime import batch_split, tuned_global_batch
from policies import LossScale, ModeFacts, Policy, default_reduce_dtype, mode_facts
from probes import MpadviseError, UsageError

DEVICES = ("cuda", "cpu")

# The format a file's extension asks ``--out`` for.
FORMAT_OF_SUFFIX: Mapping[str, str] = {".py": "python", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}

_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class ExportRefused(MpadviseError):
    """The target cannot express the policy faithfully; the message says what and why (exit 1)."""


@dataclass(frozen=True)
class ExportWarning:
    """A bounded difference between the policy and what the target runs.

    Attributes:
        id: a short, stable name for scripts (``deepspeed-tf32``).
        message: one sentence for people: what differs, and by how much.
    """

    id: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "message": self.message}


@dataclass(frozen=True)
class Export:
    """A policy written in one target's own terms.

    Attributes:
        target: the ``--to`` name of the target.
        text: what to paste or save: Python source, DeepSpeed's JSON, or a YAML config file.
        format: the language of ``text`` (``"python"``, ``"json"`` or ``"yaml"``).
        data: the same settings as plain data, for ``--json``.
        warnings: the named, bounded differences.
        notes: what the user must still do that ``text`` cannot say.
        alternates: the same policy in the target's other formats (Accelerate's config file),
            or, where that format cannot carry the policy, the refusal's message.
    """

    target: str
    text: str
    format: str
    data: Mapping[str, Any]
    warnings: tuple[ExportWarning, ...] = ()
    notes: tuple[str, ...] = ()
    alternates: Mapping[str, Export | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "format": self.format,
            "text": self.text,
            "settings": dict(self.data),
            "warnings": [w.to_dict() for w in self.warnings],
            "notes": list(self.notes),
        }

    def for_file(self, path: str | PurePath) -> Export:
        """The export in the format ``path``'s extension names (``.py``, ``.json``, ``.yaml``).

        Raises:
            UsageError: an extension of no format this target writes, naming those it does.
            ExportRefused: the format exists, but cannot carry this policy (the reason).
        """
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


# ---- shared -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Split:
    """The batch a policy sets: ``micro`` samples a forward pass (``None``: the script's own),
    ``accum`` micro-batches an optimizer step."""

    micro: int | None
    accum: int


@dataclass
class _Job:
    """One export being written: the policy, the target, and the warnings and notes gathered."""

    policy: Policy
    target: str
    title: str
    device: str
    source: str | None
    traits: FrameworkTraits | None = None
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

    def header(self) -> list[str]:
        """The first statement: a string literal naming the policy, its source and the target.

        A literal, not a comment: the source is a path from outside, and ``repr`` keeps any
        newline or quote in it inside the string.
        """
        where = "CUDA" if self.cuda else "a CPU"
        origin = f", from {self.source}" if self.source else ""
        return [repr(f"mpadvise policy {self.policy.describe()}{origin}, for {self.title} on {where}.")]

    def check_framework(self, policy: Policy | None = None) -> None:
        """The framework's own refusal (its traits), for the four frameworks mpadvise tunes through."""
        if self.traits is None:
            return
        reason = self.traits.refusal(policy or self.policy, device=self.device)
        if reason is not None:
            raise self.refuse(reason)

    def split(self) -> _Split | None:
        """The batch the policy sets, or ``None`` where it keeps the script's batch and accumulation.

        A policy that sets a micro-batch without ``grad_accum_steps`` accumulates up to the
        script's batch, which an export cannot see, unless the policy records the global batch
        it was tuned at.
        """
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

    def python(self, *blocks: list[str], data: Mapping[str, Any]) -> Export:
        """A Python export: the header, then ``blocks``."""
        text = "\n".join(_code(self.header(), *blocks)) + "\n"
        return Export(self.target, text, "python", data, tuple(self.warnings), tuple(self.notes))


def _code(*blocks: list[str]) -> list[str]:
    """Blocks of lines one blank line apart; two around a class or a function, as PEP 8 has it."""
    out: list[str] = []
    previous: list[str] = []
    for block in blocks:
        if not block:
            continue
        if out:
            out.append("")
            if _is_definition(block) or _is_definition(previous):
                out.append("")
        out.extend(block)
        previous = block
    return out


def _is_definition(block: list[str]) -> bool:
    return bool(block) and block[0].startswith(("class ", "def "))


class _Code(str):
    """Source code of the export's own (fixed text and ``_py`` literals), written as it is."""


def _comment(text: str) -> list[str]:
    """``text`` (the export's own words and numbers) as comment lines of at most 100 characters."""
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
    if not items:
        return [f"{indent}{name}()"]
    return [f"{indent}{name}(", *(f"{indent}    {item}," for item in items), f"{indent})"]


def _tf32_lines(tf32: bool, *, cuda: bool, mode: str) -> list[str]:
    """The TF32 switches as ``policies``' fp32/tf32 modes set them (``policies._switches``).

    torch >= 2.9 keeps the switches twice (the legacy API and ``fp32_precision``); both are
    set, legacy first, so that code reading either agrees: Lightning reads the legacy matmul
    precision, and the legacy ``cudnn.allow_tf32 = False`` alone leaves the new cuDNN switches
    inheriting, which can still mean TF32.
    """
    legacy, new = ("high", "tf32") if tf32 else ("highest", "ieee")
    state = "on" if tf32 else "off"
    what = "fp32 matmuls and cuDNN convolutions" if cuda else "fp32 matmuls"
    lines = [
        *_comment(f"{mode}: TF32 {state} for {what}, as mpadvise sets it, in both of torch's TF32 APIs."),
        f"torch.set_float32_matmul_precision({_py(legacy)})",
    ]
    if cuda:
        lines.append(f"torch.backends.cudnn.allow_tf32 = {_py(tf32)}")
    lines += [
        'if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9',
        f"    torch.backends.cuda.matmul.fp32_precision = {_py(new)}",
        f"    torch.backends.mkldnn.matmul.fp32_precision = {_py(new)}",
    ]
    if cuda:
        lines += [
            f"    torch.backends.cudnn.conv.fp32_precision = {_py(new)}",
            f"    torch.backends.cudnn.rnn.fp32_precision = {_py(new)}",
        ]
    return lines


def _scaler_settings(ls: LossScale) -> dict[str, Any]:
    return {"kind": ls.kind, "init_scale": float(ls.init_scale), "growth_factor": float(ls.growth_factor),
            "backoff_factor": float(ls.backoff_factor), "growth_interval": int(ls.growth_interval)}


def _dataloader_line(split: _Split | None, owner: str) -> list[str]:
    if split is None or split.micro is None:
        return []
    per_step = f" ({split.accum} micro-batches per optimizer step)" if split.accum > 1 else ""
    return _comment(f"The DataLoader's batch_size must be {split.micro}, the policy's micro-batch: {owner} "
                    f"does not set it{per_step}.")


class Exporter:
    """Writes a Policy in one target's own settings: faithful, or refused with the reason.

    A subclass names its target (``mpadvise export --to TARGET``) and its title, and writes the
    export in ``write``.
    """

    target: ClassVar[str]
    title: ClassVar[str]

    def export(self, policy: Policy, *, traits: FrameworkTraits | None, device: str,
               source: str | None) -> Export:
        """``policy`` as this target's settings.

        Args:
            policy: the policy to export.
            traits: the framework's traits, which judge what it can apply; ``None`` for the
                export-only targets (DeepSpeed, torchtitan), which judge for themselves.
            device: ``"cuda"`` or ``"cpu"``, where the export will train.
            source: where the policy came from (a config path), for the header.

        Raises:
            UsageError: an unknown device.
            ExportRefused: the target cannot express the policy; one line saying what and why.
        """
        if device not in DEVICES:
            raise UsageError(f"unknown device {device!r} for an export; expected one of {', '.join(DEVICES)}")
        return self.write(_Job(policy, self.target, self.title, device, source, traits))

    def write(self, job: _Job) -> Export:
        """The target's settings for ``job`` (each exporter defines it)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not say what it writes; define write(job)")
