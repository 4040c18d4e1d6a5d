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
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, ClassVar

from advisor.frameworks._accelerate import (
    AccelerateSettings,
    accelerate_settings,
    grad_scaler_kwargs,
)
from advisor.frameworks._lightning import (
    LightningPrecision,
    lightning_precision,
    transformer_engine_args,
)
from advisor.frameworks._traits import FrameworkTraits
from advisor.frameworks._transformers import transformers_precision
from advisor.runtime import batch_split, tuned_global_batch
from policies import (
    Fp8Te,
    Fp8Torchao,
    LossScale,
    ModeFacts,
    Policy,
    default_reduce_dtype,
    mode_facts,
)
from probes import MpadviseError, UsageError

DEVICES = ("cuda", "cpu")

# The format a file's extension asks ``--out`` for.
FORMAT_OF_SUFFIX: Mapping[str, str] = {".py": "python", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}

# DeepSpeed runs torch.autocast from its "torch_autocast" section: bf16 since 0.17.2; fp16 with
# a GradScaler at every ZeRO stage since 0.18.0 (read in the sources of those releases). An
# older DeepSpeed ignores the section and trains in fp32.
DEEPSPEED_AUTOCAST_SINCE = {"bf16": "0.17.2", "fp16": "0.18.0"}
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


_STATIC_SCALER = [
    "class StaticGradScaler(torch.amp.GradScaler):",
    '    """A GradScaler whose scale stays fixed; a step whose gradients overflow is still skipped."""',
    "",
    "    def __init__(self, device: str, scale: float) -> None:",
    "        super().__init__(device, init_scale=scale)",
    "        self.static_scale = scale",
    "",
    "    def update(self, new_scale=None) -> None:",
    "        super().update(self.static_scale if new_scale is None else new_scale)",
]


def _scaler_code(ls: LossScale, device: str) -> list[str]:
    """``scaler = ...``: a GradScaler carrying ``ls``, dynamic, static (``StaticGradScaler``) or off."""
    if ls.kind == "static":
        return [f"scaler = StaticGradScaler({_py(device)}, {_py(float(ls.init_scale))})"]
    if ls.kind == "none":
        return [f"scaler = torch.amp.GradScaler({_py(device)}, enabled=False)  # no loss scaling"]
    settings = {k: v for k, v in _scaler_settings(ls).items() if k != "kind"}
    return _call("scaler = torch.amp.GradScaler", settings, args=(device,))


def _dataloader_line(split: _Split | None, owner: str) -> list[str]:
    if split is None or split.micro is None:
        return []
    per_step = f" ({split.accum} micro-batches per optimizer step)" if split.accum > 1 else ""
    return _comment(f"The DataLoader's batch_size must be {split.micro}, the policy's micro-batch: {owner} "
                    f"does not set it{per_step}.")


# ---- the exporters ----------------------------------------------------------------------------


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


# ---- Lightning: the Trainer and Fabric --------------------------------------------------------


class LightningExporter(Exporter):
    """The Lightning Trainer's arguments: a precision string or plugin, accumulation, clipping."""

    target = "lightning"
    title = "the Lightning Trainer"
    package = "lightning.pytorch"
    cls = "Trainer"

    def write(self, job: _Job) -> Export:
        policy = job.policy
        # The Trainer and Fabric do not own the batch: a split is the DataLoader's batch_size
        # (said in a comment) with accumulation, so the traits judge the rest of the policy.
        # The batch split and clipping are the script's here: the export says how to set them in it.
        job.check_framework(policy.with_(micro_batch_size=None, grad_accum_steps=None, grad_clip_norm=None))
        split = job.split()
        job.reduce_dtype_warning()
        plan = lightning_precision(policy)
        imports = [f"from {self.package} import {self.cls}"]
        kwargs: dict[str, Any] = {}
        data: dict[str, Any] = {"precision": None, "plugin": None}
        setup = self._precision(job, plan, imports, kwargs, data)
        switches = [] if plan.tf32 is None else _tf32_lines(plan.tf32, cuda=job.cuda, mode=policy.mode)
        if setup or switches:
            imports.insert(0, "import torch")
        data["tf32"] = plan.tf32
        data["dataloader_batch_size"] = split.micro if split is not None else None
        comments = _dataloader_line(split, f"the {self.cls}") + self._loop(job, split, kwargs, data)
        build = [*comments, f"# Pass these arguments to your {self.cls}(...).",
                 *_call(f"{self.cls.lower()} = {self.cls}", kwargs)]
        return job.python(imports, *setup, switches, build, data=data)

    def _precision(self, job: _Job, plan: LightningPrecision, imports: list[str], kwargs: dict[str, Any],
                   data: dict[str, Any]) -> list[list[str]]:
        """The precision argument (in ``kwargs``) and the blocks that build its plugin."""
        package = self.package
        if plan.plugin == "amp":
            # What the Lightning adapter applies to fp16-mixed: MixedPrecision carrying the
            # policy's GradScaler (the "16-mixed" string builds a default one, and on a CPU
            # Lightning turns it into bf16-mixed).
            ls = plan.loss_scale or LossScale()
            imports.append(f"from {package}.plugins import MixedPrecision")
            kwargs["plugins"] = _Code(f"[MixedPrecision({_py('16-mixed')}, {_py(job.device)}, scaler=scaler)]")
            data["plugin"] = {"class": "MixedPrecision", "precision": "16-mixed", "device": job.device,
                              "scaler": _scaler_settings(ls)}
            return [list(_STATIC_SCALER) if ls.kind == "static" else [], _scaler_code(ls, job.device)]
        if plan.plugin == "transformer-engine":
            if not job.cuda:
                raise job.refuse("Transformer Engine runs on CUDA only")
            te = transformer_engine_args(job.policy)
            imports.append(f"from {package}.plugins import TransformerEnginePrecision")
            plugin = _call("plugin = TransformerEnginePrecision", {
                "weights_dtype": _Code(f"torch.{_TORCH_DTYPE_NAMES[te['weights_dtype']]}"),
                "fallback_compute_dtype": _Code(f"torch.{_TORCH_DTYPE_NAMES[te['fallback_compute_dtype']]}"),
                "recipe": te["recipe"],
            })
            kwargs["plugins"] = _Code("[plugin]")
            data["plugin"] = {"class": "TransformerEnginePrecision", **te}
            # Lightning's layer swap (_convert_layers) takes in_features % 8 and out_features % 16;
            # mpadvise's takes both % 16, and Transformer Engine's FP8 GEMM wants the input's last
            # dimension % 16: such a layer fails at its first forward rather than training otherwise.
            job.warn(
                "lightning-te-layer-swap",
                "Lightning swaps every Linear whose in_features is a multiple of 8 and out_features of 16, "
                "where mpadvise keeps a Linear with in_features not a multiple of 16 in bf16; Transformer "
                "Engine refuses such a layer at its first forward, so a model with one fails rather than "
                "training differently",
            )
            return [plugin]
        kwargs["precision"] = plan.precision
        data["precision"] = plan.precision
        return []

    def _loop(self, job: _Job, split: _Split | None, kwargs: dict[str, Any], data: dict[str, Any]) -> list[str]:
        """Accumulation and clipping: the Trainer's arguments (Fabric's override says how)."""
        clip = job.policy.grad_clip_norm
        if split is not None:
            kwargs["accumulate_grad_batches"] = split.accum
        if clip is not None:
            kwargs["gradient_clip_val"] = float(clip)
            kwargs["gradient_clip_algorithm"] = "norm"
        data["trainer"] = {k: v for k, v in kwargs.items() if k not in ("precision", "plugins")}
        return []


# Lightning's dtype names, for the TE plugin's arguments (``transformer_engine_args`` names them).
_TORCH_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class FabricExporter(LightningExporter):
    """Lightning Fabric's arguments; accumulation and clipping are the loop's, said in comments."""

    target = "fabric"
    title = "Lightning Fabric"
    package = "lightning.fabric"
    cls = "Fabric"

    def _loop(self, job: _Job, split: _Split | None, kwargs: dict[str, Any], data: dict[str, Any]) -> list[str]:
        clip = job.policy.grad_clip_norm
        accum = split.accum if split is not None else None
        data["accumulate"] = accum
        data["clip_grad_norm"] = clip
        comments: list[str] = []
        if accum is not None and accum > 1:
            comments += _comment(
                f"Fabric leaves accumulation to the loop: step the optimizer every {accum} batches, with "
                f"fabric.backward(loss / {accum}) and fabric.no_backward_sync(model, enabled=not stepping)."
            )
        if clip is not None:
            comments += _comment(
                f"Clip as the policy does: fabric.clip_gradients(model, optimizer, "
                f"max_norm={float(clip)!r}) before optimizer.step()."
            )
        return comments


# ---- the Hugging Face Trainer ---------------------------------------------------------------


class TransformersExporter(Exporter):
    """``TrainingArguments`` fields: precision, the device, and what the policy sets of batch and clipping."""

    target = "transformers"
    title = "the Hugging Face Trainer"

    def write(self, job: _Job) -> Export:
        policy, facts = job.policy, job.facts
        job.check_framework()
        ls = policy.loss_scale
        if facts.loss_scaling and ls is not None and ls.kind == "none":
            # The traits pass a policy without loss scaling, yet fp16=True always builds a GradScaler.
            raise job.refuse(
                "the HF Trainer scales every fp16 loss with a dynamic GradScaler, and the policy has no loss scaling"
            )
        if facts.autocast == "fp16" and not job.cuda:
            raise job.refuse(
                "on a CPU the HF Trainer's Accelerate turns neither fp16 autocast nor a GradScaler on, so fp16=True "
                "would train in fp32"
            )
        if facts.tf32 and not job.cuda:
            raise job.refuse("TrainingArguments(tf32=True) needs an Ampere or newer GPU; on a CPU it raises")
        split = job.split()
        job.reduce_dtype_warning()
        fields: dict[str, Any] = dict(transformers_precision(policy))
        if not job.cuda:
            # TrainingArguments refuses bf16 without a GPU unless told to train on the CPU.
            fields["use_cpu"] = True
        if split is not None:
            if split.micro is not None:
                fields["per_device_train_batch_size"] = split.micro
            fields["gradient_accumulation_steps"] = split.accum
        else:
            job.notes.append("the policy keeps the script's batch: per_device_train_batch_size and "
                             "gradient_accumulation_steps stay as the script sets them")
        # Only a policy that clips sets max_grad_norm: the trials kept the script's own value
        # (TrainingArguments' default clips at 1.0), so leaving it out exports what was measured.
        if policy.grad_clip_norm is not None:
            fields["max_grad_norm"] = float(policy.grad_clip_norm)
        body = ["# Pass these fields to TrainingArguments: TrainingArguments(output_dir=..., **training_arguments).",
                f"training_arguments = {_py(fields)}"]
        return job.python(body, data={"training_arguments": fields})


# ---- Accelerate -------------------------------------------------------------------------------


class AccelerateExporter(Exporter):
    """Code that builds the ``Accelerator`` with its kwargs handlers; or its YAML config file."""

    target = "accelerate"
    title = "Accelerate"

    def write(self, job: _Job) -> Export:
        policy, facts = job.policy, job.facts
        # Accelerate does not own the batch either (the script's DataLoader does).
        # The batch split and clipping are the script's here: the export says how to set them in it.
        job.check_framework(policy.with_(micro_batch_size=None, grad_accum_steps=None, grad_clip_norm=None))
        split = job.split()
        job.reduce_dtype_warning()
        if facts.fp8_library == "torchao" and not job.cuda:
            raise job.refuse(
                "on a CPU Accelerate runs FP8 under bf16 autocast, where mpadvise's CPU emulation runs the "
                "other layers in fp32"
            )
        if facts.fp8_library == "transformer_engine" and not job.cuda:
            raise job.refuse("Transformer Engine runs on CUDA only")
        try:
            settings = accelerate_settings(policy)
        except MpadviseError as exc:
            raise job.refuse(str(exc)) from None
        config_file = self._config_file(job, settings)
        yaml_text = _yaml(config_file)
        code = _AccelerateCode(job, settings, split)
        data = {
            "config_file": config_file,
            "config_file_yaml": yaml_text,
            "accelerator": {k: v for k, v in code.accelerator.items() if k != "kwargs_handlers"},
            "kwargs_handlers": code.handler_data,
            "tf32": settings.tf32,
            "dataloader_batch_size": split.micro if split is not None else None,
            "clip_grad_norm": policy.grad_clip_norm,
        }
        config_comment = [
            "# The same precision as an accelerate config file, for `accelerate launch --config_file FILE`",
            "# (merge mixed_precision and fp8_config into your own for more processes or machines):",
            *(f"#   {line}" for line in yaml_text.splitlines()),
        ]
        export = job.python(code.stdlib, code.imports, *code.fp8_layers, code.switches, config_comment,
                            code.build, data=data)
        return _with_alternates(export, {"yaml": self._yaml_export(job, settings, split, config_file, yaml_text)})

    @staticmethod
    def _config_file(job: _Job, settings: AccelerateSettings) -> dict[str, Any]:
        config_file: dict[str, Any] = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "NO",
            "num_processes": 1,
            "mixed_precision": settings.mixed_precision,
            "use_cpu": not job.cuda,
            "debug": False,
        }
        if settings.te_recipe is not None:
            config_file["fp8_config"] = {"backend": "TE"}
        if settings.torchao_recipe is not None:
            config_file["fp8_config"] = {"backend": "AO"}
        return config_file

    @staticmethod
    def _yaml_export(job: _Job, settings: AccelerateSettings, split: _Split | None,
                     config_file: dict[str, Any], yaml_text: str) -> Export | str:
        """The config file alone, for ``accelerate launch --config_file``; or why it cannot carry the policy."""
        needs_code = []
        if settings.grad_scaler is not None and settings.grad_scaler != grad_scaler_kwargs(LossScale()):
            needs_code.append("the GradScaler's settings (GradScalerKwargs)")
        if settings.te_recipe is not None or settings.torchao_recipe is not None:
            needs_code.append("the FP8 recipe and layer filter (kwargs handlers)")
        if settings.mixed_precision == "fp16" and not job.cuda:
            needs_code.append("fp16 autocast on a CPU (Accelerate turns it on only on a GPU)")
        if settings.tf32 is not None:
            needs_code.append(f"the TF32 switches of {job.policy.mode}")
        if needs_code:
            return str(job.refuse(f"an accelerate config file cannot carry {' or '.join(needs_code)}; "
                                  "write the Python export (--out FILE.py), which builds them"))
        notes = []
        if split is not None and split.micro is not None:
            notes.append(f"set the DataLoader's batch_size to {split.micro}, the policy's micro-batch")
        if split is not None and split.accum > 1:
            notes.append(f"pass gradient_accumulation_steps={split.accum} to Accelerator(...) and run each "
                         "micro-batch under `with accelerator.accumulate(model):`")
        if job.policy.grad_clip_norm is not None:
            notes.append(f"clip as the policy does: accelerator.clip_grad_norm_(model.parameters(), "
                         f"{float(job.policy.grad_clip_norm)!r}) before optimizer.step()")
        return Export(job.target, yaml_text, "yaml", {"config_file": config_file}, tuple(job.warnings), tuple(notes))


def _with_alternates(export: Export, alternates: Mapping[str, Export | str]) -> Export:
    return Export(export.target, export.text, export.format, export.data, export.warnings, export.notes,
                  dict(alternates))


def _yaml(mapping: Mapping[str, Any]) -> str:
    """``mapping`` as YAML, by PyYAML's safe writer (it quotes what YAML 1.1 would read as a bool: 'no')."""
    # PyYAML comes with Accelerate, which reads this file: the accelerate export needs nothing more.
    import yaml

    return yaml.safe_dump(dict(mapping), sort_keys=False, default_flow_style=False)


class _AccelerateCode:
    """The Python of an Accelerate export, block by block: imports, FP8 layers, switches, the build."""

    def __init__(self, job: _Job, settings: AccelerateSettings, split: _Split | None) -> None:
        self.stdlib: list[str] = []
        self.imports = ["from accelerate import Accelerator"]
        self.utils: list[str] = []
        self.fp8_layers: list[list[str]] = []
        self.handlers: list[str] = []
        self.handler_data: list[dict[str, Any]] = []
        self._handlers(job, settings)
        if self.utils:
            self.imports.append(f"from accelerate.utils import {', '.join(self.utils)}")
        if settings.torchao_recipe is not None:
            self.imports.append("from torchao.float8 import Float8LinearConfig")
        tf32 = settings.tf32
        self.switches = [] if tf32 is None else _tf32_lines(tf32, cuda=job.cuda, mode=job.policy.mode)
        cpu_fp16 = settings.mixed_precision == "fp16" and not job.cuda
        if self.switches or self.fp8_layers or cpu_fp16:
            self.imports.insert(0, "import torch")
        self.accelerator: dict[str, Any] = {"mixed_precision": settings.mixed_precision}
        self.build = self._build(job, settings, split, cpu_fp16)

    def _handlers(self, job: _Job, settings: AccelerateSettings) -> None:
        if settings.grad_scaler is not None:
            self.utils.append("GradScalerKwargs")
            self.handlers += _call("GradScalerKwargs", settings.grad_scaler, indent="    ")
            self.handler_data.append({"class": "GradScalerKwargs", "kwargs": dict(settings.grad_scaler)})
        if settings.te_recipe is not None:
            self.utils.append("TERecipeKwargs")
            self.handlers += _call("TERecipeKwargs", settings.te_recipe, indent="    ")
            self.handler_data.append({"class": "TERecipeKwargs", "kwargs": dict(settings.te_recipe)})
            multiple = Fp8Te.recipe_rule(Fp8Te.policy_recipe(job.policy)).dim_multiple
            # accelerate/utils/transformer_engine.py, convert_model (1.15): a Linear whose weight
            # has a dimension not a multiple of 16 ends the swap of its parent's remaining
            # children (a `return` inside the loop), so later layers stay in high precision.
            job.warn(
                "accelerate-te-layer-swap",
                "Accelerate swaps Linear layers for Transformer Engine's by its own rule: weight dimensions "
                "multiples of 16, and a Linear that fails it leaves its later siblings unswapped (in bf16: "
                f"more precise, slower), where mpadvise swaps each Linear whose dimensions are multiples of {multiple}"
                + ("; MXFP8 refuses a swapped layer with a dimension not a multiple of 32 at its first forward"
                   if multiple > 16 else ""),
            )
        if settings.torchao_recipe is not None:
            self._torchao(settings.torchao_recipe)

    def _torchao(self, recipe: str) -> None:
        rule = Fp8Torchao.recipe_rule(recipe)
        pad = rule.token_multiple > 1
        multiple = int(rule.dim_multiple)
        self.utils.append("AORecipeKwargs")
        self.stdlib.append("import dataclasses")
        self.fp8_layers.append([
            "def fp8_layer_filter(module: torch.nn.Module, fqn: str) -> bool:",
            f'    """The layers mpadvise runs in FP8: each Linear with features multiples of {multiple}."""',
            "    return (",
            "        isinstance(module, torch.nn.Linear)",
            f"        and module.in_features % {multiple} == 0",
            f"        and module.out_features % {multiple} == 0",
            "    )",
        ])
        config_lines = [f"fp8_config = Float8LinearConfig.from_recipe_name({_py(recipe)})"]
        if pad:
            config_lines += ["# torch._scaled_mm wants the token count a multiple of 16: pad with zero rows (exact).",
                             "fp8_config = dataclasses.replace(fp8_config, pad_inner_dim=True)"]
        self.fp8_layers.append(config_lines)
        self.handlers += ["    AORecipeKwargs(config=fp8_config, module_filter_func=fp8_layer_filter),"]
        self.handler_data.append({
            "class": "AORecipeKwargs", "recipe": recipe, "pad_inner_dim": pad,
            "module_filter": f"torch.nn.Linear with in and out features multiples of {multiple}",
        })

    def _build(self, job: _Job, settings: AccelerateSettings, split: _Split | None, cpu_fp16: bool) -> list[str]:
        build = _dataloader_line(split, "the Accelerator")
        if split is not None:
            self.accelerator["gradient_accumulation_steps"] = split.accum
            if split.accum > 1:
                build += _comment(f"Run each micro-batch under `with accelerator.accumulate(model):`; "
                                  f"it steps every {split.accum}.")
        clip = job.policy.grad_clip_norm
        if clip is not None:
            build += _comment(f"Clip as the policy does: accelerator.clip_grad_norm_(model.parameters(), "
                              f"{float(clip)!r}) before optimizer.step().")
        if self.handlers:
            build += ["kwargs_handlers = [", *_closed(self.handlers), "]"]
            self.accelerator["kwargs_handlers"] = _Code("kwargs_handlers")
        build += _call("accelerator = Accelerator", self.accelerator)
        if cpu_fp16:
            # What the Accelerate adapter does in a trial on a CPU.
            build += [
                "# On a CPU Accelerate turns neither fp16 autocast nor a GradScaler on (it would train in fp32):",
                "# turn them on, as mpadvise's trials do.",
                *_call("accelerator.scaler = torch.amp.GradScaler", settings.grad_scaler or {}, args=("cpu",)),
                "accelerator.native_amp = True",
            ]
        return build


def _closed(handler_lines: list[str]) -> list[str]:
    """Handler calls as list items: the closing line of a multi-line call gets the comma."""
    return [line + "," if line.strip() == ")" else line for line in handler_lines]


# ---- DeepSpeed --------------------------------------------------------------------------------


class DeepSpeedExporter(Exporter):
    """DeepSpeed's JSON config: the batch the policy sets, clipping, and torch_autocast."""

    target = "deepspeed"
    title = "DeepSpeed"

    def write(self, job: _Job) -> Export:
        self._check(job)
        split = job.split()
        job.reduce_dtype_warning()
        facts = job.facts
        config: dict[str, Any] = {}
        if split is not None and split.micro is not None:
            config["train_micro_batch_size_per_gpu"] = split.micro
        else:
            job.notes.append("add train_micro_batch_size_per_gpu (the script's batch size per GPU): DeepSpeed "
                             "requires a batch size, and the policy keeps the script's")
        if split is not None:
            config["gradient_accumulation_steps"] = split.accum
        else:
            job.notes.append("add gradient_accumulation_steps if the script accumulates (DeepSpeed's default is 1): "
                             "the policy keeps the script's accumulation")
        if job.policy.grad_clip_norm is not None:
            config["gradient_clipping"] = float(job.policy.grad_clip_norm)
        else:
            # Every trial clipped as the script does: DeepSpeed clips at 1.0 unless told, so the
            # script's own max norm is the value to set.
            job.notes.append("add gradient_clipping, the max norm the script clips at (0.0 if it does not): "
                             "DeepSpeed clips at 1.0 by default, and the policy keeps the script's clipping")
        config["fp16"] = {"enabled": False}
        config["bf16"] = {"enabled": False}
        if facts.autocast is not None:
            # An empty lower_precision_safe_modules keeps every gradient's reduction in fp32, as
            # DDP does under autocast; DeepSpeed's default list would reduce Linear and Conv
            # gradients in 16 bits.
            config["torch_autocast"] = {"enabled": True, "dtype": _TORCH_DTYPE[facts.autocast],
                                        "lower_precision_safe_modules": []}
            job.notes.append(f"needs DeepSpeed {DEEPSPEED_AUTOCAST_SINCE[facts.autocast]} or newer for "
                             "torch_autocast; an older one ignores the section and trains in fp32")
        self._tf32_warning(job, facts.tf32)
        text = json.dumps(config, indent=2) + "\n"
        return Export(job.target, text, "json", {"config": config}, tuple(job.warnings), tuple(job.notes))

    @staticmethod
    def _check(job: _Job) -> None:
        """Refuse what DeepSpeed's config cannot express."""
        policy, facts = job.policy, job.facts
        # DeepSpeed's "fp16" and "bf16" sections cast the model to 16 bits and keep fp32 master
        # weights (Apex's O2): every operation runs in half precision, softmax, norms and the loss
        # included, where the policy's -mixed modes run torch.autocast over fp32 weights and keep
        # those in fp32. That is not a bounded difference, so autocast modes go through DeepSpeed's
        # "torch_autocast" section. Pure 16-bit weights are refused: DeepSpeed's 16-bit sections
        # always keep fp32 masters and optimizer state.
        if facts.weights != "fp32":
            raise job.refuse(
                "DeepSpeed's fp16 and bf16 training keeps fp32 master weights and optimizer state, so it is not "
                "pure 16-bit training (memory and speed differ from what was measured)"
            )
        if facts.fp8_library is not None or facts.autocast not in (None, *DEEPSPEED_AUTOCAST_SINCE):
            raise job.refuse(
                f"DeepSpeed's config has no {policy.mode} training (it can express fp32 weights under fp16 or bf16 "
                "autocast, and the TF32 choice as a warning)"
            )
        if not job.cuda and facts.autocast == "fp16":
            raise job.refuse("DeepSpeed's torch_autocast builds its GradScaler for the accelerator's device, not a CPU")
        ls = policy.loss_scale
        if not facts.loss_scaling or ls is None:
            return
        if ls.kind == "none":
            raise job.refuse("DeepSpeed's torch_autocast scales every fp16 loss with a dynamic GradScaler, "
                             "and the policy has no loss scaling")
        default = _scaler_settings(LossScale())
        changed = [name for name, value in _scaler_settings(ls).items() if name != "kind" and value != default[name]]
        if ls.kind == "static" or changed:
            what = "a static loss scale" if ls.kind == "static" else f"GradScaler's {', '.join(changed)}"
            raise job.refuse(
                f"DeepSpeed's torch_autocast builds torch.amp.GradScaler with its defaults (dynamic, initial scale "
                f"65536, growth interval 2000) and cannot apply {what}; its fp16 section, which takes loss-scale "
                "settings, trains fp16 weights with fp32 masters, not autocast"
            )

    @staticmethod
    def _tf32_warning(job: _Job, tf32: bool | None) -> None:
        if tf32 is False:
            job.warn(
                "deepspeed-tf32",
                "DeepSpeed's config has no TF32 switch, and torch runs cuDNN convolutions in TF32 by default: for "
                "exact fp32 set torch.backends.cudnn.allow_tf32 = False in the script (and on torch >= 2.9 "
                'torch.backends.cudnn.conv.fp32_precision = "ieee"), as `mpadvise export --to lightning` writes',
            )
        elif tf32 is True:
            job.warn(
                "deepspeed-tf32",
                "DeepSpeed's config has no TF32 switch: set torch.set_float32_matmul_precision(\"high\") in the "
                "script (and the cuDNN switches, as `mpadvise export --to lightning` writes), or fp32 matmuls run "
                "in IEEE fp32: slower, not less precise",
            )


# ---- torchtitan -------------------------------------------------------------------------------


class TorchtitanExporter(Exporter):
    """A function that sets the policy on torchtitan's ``Trainer.Config`` (torchtitan 0.3)."""

    target = "torchtitan"
    title = "torchtitan"

    def write(self, job: _Job) -> Export:
        facts = job.facts
        float8 = self._check(job)
        training: dict[str, Any] = {
            "dtype": _TORCH_DTYPE[facts.weights],
            # torchtitan applies the parameter dtype as FSDP2's MixedPrecisionPolicy when it shards
            # and as torch.autocast otherwise: what mpadvise's bf16-mixed does in either case; its
            # FP8 runs the layers it does not convert in bf16.
            "mixed_precision_param": "bfloat16" if (facts.autocast == "bf16" or facts.weights == "bf16"
                                                    or facts.fp8_library is not None) else "float32",
            "mixed_precision_reduce": "float32",
        }
        if job.policy.grad_clip_norm is not None:
            training["max_norm"] = float(job.policy.grad_clip_norm)
        else:
            job.notes.append("training.max_norm stays as the config sets it (torchtitan clips at 1.0 by default): "
                             "the policy keeps the script's clipping, so set it to the norm the script clips at")
        self._warnings(job)
        split = job.split()
        if split is None:
            job.notes.append("training.local_batch_size and global_batch_size stay as the config sets them: the "
                             "policy keeps the script's batch")
        switches = [] if facts.tf32 is None else _tf32_lines(facts.tf32, cuda=job.cuda, mode=job.policy.mode)
        imports = (["import torch"] if switches else []) + (
            ["from torchtitan.components.quantization import Float8LinearConverter"] if float8 is not None else [])
        converter = [] if float8 is None else [
            "# FP8 on each Linear whose dimensions are multiples of 16, as mpadvise converts;",
            "# give it to the model: model_registry(flavor, converters=[FLOAT8_CONVERTER]).",
            *_call("FLOAT8_CONVERTER = Float8LinearConverter.Config", float8),
        ]
        data = {"training": training, "float8": float8, "tf32": facts.tf32,
                "micro_batch_size": split.micro if split is not None else None,
                "grad_accum_steps": split.accum if split is not None else None}
        about = ["# torchtitan's Python config (Trainer.Config, torchtitan 0.3): apply the function to the",
                 "# config your config_registry function returns."]
        return job.python(about, imports, switches, converter, self._function(job, training, split), data=data)

    @staticmethod
    def _check(job: _Job) -> dict[str, Any] | None:
        """Refuse what torchtitan cannot train; the float8 converter's fields, for FP8."""
        facts, mode = job.facts, job.policy.mode
        if "fp16" in (facts.autocast, facts.weights):
            raise job.refuse(
                "torchtitan has no fp16 training (training.dtype and mixed_precision_param take bfloat16 or float32)"
            )
        if facts.fp8_library == "transformer_engine":
            raise job.refuse("torchtitan has no Transformer Engine path; its FP8 is torchao's (fp8-torchao)")
        if facts.fp8_library not in (None, "torchao"):
            raise job.refuse(f"torchtitan has no {mode} training")
        if facts.fp8_library is None:
            return None
        recipe = facts.fp8_recipe(job.policy)
        if recipe not in _TORCHTITAN_FLOAT8_RECIPES:
            raise job.refuse(
                f"torchtitan's Float8LinearConverter offers the {' and '.join(_TORCHTITAN_FLOAT8_RECIPES)} recipes "
                f"only, not {recipe}; set [fp8] recipe to one of those and tune it"
            )
        # torchtitan's converter takes each Linear whose dimensions are multiples of 16, less
        # filter_fqns: with none, mpadvise's filter.
        return {"recipe_name": recipe, "filter_fqns": []}

    @staticmethod
    def _warnings(job: _Job) -> None:
        facts = job.facts
        if facts.weights == "bf16":
            job.warn(
                "torchtitan-bf16-fp32-logits",
                "torchtitan's bf16 training keeps RoPE and the logits in fp32, where mpadvise's bf16-true runs them "
                "in bf16: more precise there, slightly slower",
            )
        reduce = job.policy.reduce_dtype or default_reduce_dtype(job.policy.mode)
        if reduce != "fp32":
            job.warn(
                "torchtitan-reduce-fp32",
                f"torchtitan reduces gradients across ranks in float32 (its only choice), where the policy reduces "
                f"in {reduce} under FSDP2: more precise, twice the reduce-scatter bytes",
            )

    @staticmethod
    def _function(job: _Job, training: Mapping[str, Any], split: _Split | None) -> list[str]:
        """``apply_mpadvise_policy(config, ...)``: the training fields, then the batch the policy sets."""
        signature = "config" if split is None else "config, data_parallel_degree=1"
        lines = [f"def apply_mpadvise_policy({signature}):",
                 f"    {_py('Set the mpadvise policy on a torchtitan Trainer.Config; returns the config.')}"]
        lines += [f"    config.training.{key} = {_py(value)}" for key, value in training.items()]
        if split is not None:
            if split.micro is not None:
                lines += [f"    # micro-batch {split.micro} sequences per data-parallel rank",
                          f"    config.training.local_batch_size = {_py(split.micro)}"]
            lines += [f"    # {split.accum} micro-batches per optimizer step on each data-parallel rank",
                      "    config.training.global_batch_size = (",
                      f"        config.training.local_batch_size * {_py(split.accum)} * data_parallel_degree",
                      "    )"]
        lines.append("    return config")
        return lines


# torchtitan's Float8LinearConverter.Config recipe_name (components/quantization/float8.py, 0.3).
_TORCHTITAN_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")
