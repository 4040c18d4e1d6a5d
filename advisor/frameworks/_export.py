"""``mpadvise export``: a Policy as a framework's own settings, faithful or refused (pure).

Each target gets the settings it reads: the Lightning Trainer and Fabric a precision string or
plugin code, the Hugging Face Trainer ``TrainingArguments`` fields, Accelerate a config file
and kwargs handlers, DeepSpeed its JSON config, torchtitan a function over its Python config.
For the four frameworks whose scripts mpadvise also tunes (Lightning, Fabric, the HF Trainer,
Accelerate), the names, the limits and what each mode becomes come from ``_traits`` and from
the adapters' own plans (``lightning_precision``, ``accelerate_settings``), so the export of a
policy is what a trial under that framework applied.

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
from typing import Any, ClassVar

from advisor.frameworks._accelerate import accelerate_settings
from advisor.frameworks._lightning import lightning_precision, transformer_engine_args
from advisor.frameworks._traits import TRANSFORMERS_PRECISION, FrameworkTraits, traits
from advisor.runtime._applied import batch_split, tuned_global_batch
from policies import Fp8Te, Fp8Torchao, LossScale, Policy
from policies._config import default_reduce_dtype
from probes import MpadviseError, UsageError

EXPORT_TARGETS: tuple[str, ...] = ("lightning", "fabric", "transformers", "accelerate", "deepspeed", "torchtitan")
"""What ``mpadvise export --to`` writes for."""

DEVICES = ("cuda", "cpu")

TITLES: Mapping[str, str] = {
    "lightning": "the Lightning Trainer",
    "fabric": "Lightning Fabric",
    "transformers": "the Hugging Face Trainer",
    "accelerate": "Accelerate",
    "deepspeed": "DeepSpeed",
    "torchtitan": "torchtitan",
}

# DeepSpeed runs torch.autocast from its "torch_autocast" section: bf16 since 0.17.2; fp16 with
# a GradScaler at every ZeRO stage since 0.18.0 (read in the sources of those releases). An
# older DeepSpeed ignores the section and trains in fp32.
DEEPSPEED_AUTOCAST_SINCE = {"bf16-mixed": "0.17.2", "fp16-mixed": "0.18.0"}


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
        target: one of ``EXPORT_TARGETS``.
        text: what to paste or save: Python source, or DeepSpeed's JSON.
        format: the language of ``text`` (``"python"`` or ``"json"``).
        data: the same settings as plain data, for ``--json``.
        warnings: the named, bounded differences.
        notes: what the user must still do that ``text`` cannot say (JSON has no comments).
    """

    target: str
    text: str
    format: str
    data: Mapping[str, Any]
    warnings: tuple[ExportWarning, ...] = ()
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "format": self.format,
            "text": self.text,
            "settings": dict(self.data),
            "warnings": [w.to_dict() for w in self.warnings],
            "notes": list(self.notes),
        }


def check_target(name: str | None) -> str:
    """``name`` if it is an export target.

    Raises:
        UsageError: a missing or unknown target, naming the targets.
    """
    if name is None:
        raise UsageError(f"missing --to TARGET; expected one of {', '.join(EXPORT_TARGETS)}")
    if name not in EXPORT_TARGETS:
        raise UsageError(f"unknown export target {name!r}; expected one of {', '.join(EXPORT_TARGETS)}")
    return name


def export_policy(policy: Policy, target: str, *, device: str = "cuda", source: str | None = None) -> Export:
    """``policy`` as ``target``'s own settings.

    Args:
        policy: the policy to export.
        target: one of ``EXPORT_TARGETS``.
        device: ``"cuda"`` or ``"cpu"``, where the export will train (a GradScaler, an
            autocast and the cuDNN switches depend on it).
        source: where the policy came from, for the header line.

    Returns:
        The export: text, data, warnings and notes.

    Raises:
        UsageError: an unknown target or device.
        ExportRefused: the target cannot express the policy; one line saying what and why.
    """
    check_target(target)
    exporter = EXPORTERS[target]()
    framework = traits(target) if target in _TUNED_FRAMEWORKS else None
    return exporter.export(policy, traits=framework, device=device, source=source)


class Exporter:
    """Writes a Policy in one target's own settings: faithful, or refused with the reason.

    A subclass names its target (``mpadvise export --to TARGET``) and overrides ``write``.
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
        return self.write(_Job(policy, self.target, device, source, traits))

    def write(self, job: _Job) -> Export:
        raise NotImplementedError


# ---- shared -----------------------------------------------------------------------------------


@dataclass
class _Job:
    """One export being written: the policy, the target, and the warnings gathered."""

    policy: Policy
    target: str
    device: str
    source: str | None
    traits: FrameworkTraits | None = None
    warnings: list[ExportWarning] = field(default_factory=list)

    def refuse(self, reason: str) -> ExportRefused:
        return ExportRefused(f"cannot export {self.policy.describe()} to {self.target}: {reason}")

    def warn(self, warning_id: str, message: str) -> None:
        self.warnings.append(ExportWarning(warning_id, message))

    def header(self) -> list[str]:
        where = "CUDA" if self.device == "cuda" else "a CPU"
        origin = f", from {self.source}" if self.source else ""
        return [f"# mpadvise policy {self.policy.describe()}{origin}", f"# for {TITLES[self.target]} on {where}."]

    def check_framework(self, policy: Policy | None = None) -> None:
        """The traits' refusal for the four frameworks mpadvise tunes through."""
        if self.traits is None:
            return
        reason = self.traits.refusal(policy or self.policy, device=self.device)
        if reason is not None:
            raise self.refuse(reason)

    def split(self) -> tuple[int | None, int]:
        """The policy's micro-batch (``None``: the script's own) and its accumulation count.

        A policy that sets a micro-batch without ``grad_accum_steps`` accumulates up to the
        script's batch, which an export cannot see, unless the policy records the global batch
        it was tuned at.
        """
        policy = self.policy
        micro, accum = policy.micro_batch_size, policy.grad_accum_steps
        if micro is not None and accum is None:
            tuned = tuned_global_batch(policy)
            if tuned is None:
                raise self.refuse(
                    f"the policy sets micro-batch {micro} without grad_accum_steps, so its accumulation "
                    "depends on the script's batch size; add grad_accum_steps to the config"
                )
            split = batch_split(policy, tuned)
            return split.micro, split.accum
        return micro, accum or 1

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

    def done(self, text_lines: list[str], fmt: str, data: dict[str, Any], notes: tuple[str, ...] = ()) -> Export:
        return Export(self.target, "\n".join(text_lines) + "\n", fmt, data, tuple(self.warnings), notes)


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
    """Source code to write as it is, where ``_py`` would write a literal."""


def _comment(text: str) -> list[str]:
    """``text`` as comment lines of at most 100 characters."""
    return textwrap.wrap(text, width=100, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def _py(value: Any) -> str:
    """A Python literal: strings in double quotes, ``float("inf")`` for infinity; ``_Code`` as is."""
    if isinstance(value, _Code):
        return str(value)
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return 'float("inf")' if math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _call(name: str, kwargs: Mapping[str, Any], *, indent: str = "", args: tuple[Any, ...] = ()) -> list[str]:
    """``name(arg, ..., key=value, ...)``, one argument a line."""
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
        lines.append(f"torch.backends.cudnn.allow_tf32 = {tf32}")
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


def _tf32_of(mode: str) -> bool | None:
    return {"fp32": False, "tf32": True}.get(mode)


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


def _dataloader_line(micro: int | None, accum: int, owner: str) -> list[str]:
    if micro is None:
        return []
    per_step = f" ({accum} micro-batches per optimizer step)" if accum > 1 else ""
    return _comment(f"The DataLoader's batch_size must be {micro}, the policy's micro-batch: {owner} "
                    f"does not set it{per_step}.")


# ---- Lightning: the Trainer and Fabric --------------------------------------------------------


def _lightning(job: _Job) -> Export:
    policy, target = job.policy, job.target
    # The Trainer and Fabric do not own the batch: a split is the DataLoader's batch_size
    # (said in a comment) with accumulation, so the traits judge the rest of the policy.
    # The batch split and clipping are the script's here: the export says how to set them in it.
    job.check_framework(policy.with_(micro_batch_size=None, grad_accum_steps=None, grad_clip_norm=None))
    micro, accum = job.split()
    job.reduce_dtype_warning()
    plan = lightning_precision(policy)
    trainer = target == "lightning"
    package = "lightning.pytorch" if trainer else "lightning.fabric"
    cls = "Trainer" if trainer else "Fabric"
    imports = [f"from {package} import {cls}"]
    scaler_class: list[str] = []
    scaler: list[str] = []
    kwargs: dict[str, Any] = {}
    data: dict[str, Any] = {"precision": None, "plugin": None}
    if plan.plugin == "amp":
        # What the Lightning adapter applies to fp16-mixed: MixedPrecision carrying the
        # policy's GradScaler (the "16-mixed" string builds a default one, and on a CPU
        # Lightning turns it into bf16-mixed).
        ls = plan.loss_scale or LossScale()
        imports.append(f"from {package}.plugins import MixedPrecision")
        if ls.kind == "static":
            scaler_class = list(_STATIC_SCALER)
        scaler = _scaler_code(ls, job.device)
        kwargs["plugins"] = _Code(f"[MixedPrecision(\"16-mixed\", {_py(job.device)}, scaler=scaler)]")
        data["plugin"] = {"class": "MixedPrecision", "precision": "16-mixed", "device": job.device,
                          "scaler": _scaler_settings(ls)}
    elif plan.plugin == "transformer-engine":
        if job.device != "cuda":
            raise job.refuse("Transformer Engine runs on CUDA only")
        te = transformer_engine_args(policy)
        imports.append(f"from {package}.plugins import TransformerEnginePrecision")
        scaler = [
            "plugin = TransformerEnginePrecision(",
            f"    weights_dtype=torch.{te['weights_dtype']},",
            f"    fallback_compute_dtype=torch.{te['fallback_compute_dtype']},",
            f"    recipe={_py(te['recipe'])},",
            ")",
        ]
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
    else:
        kwargs["precision"] = plan.precision
        data["precision"] = plan.precision
    switches = [] if plan.tf32 is None else _tf32_lines(plan.tf32, cuda=job.device == "cuda", mode=policy.mode)
    if scaler or switches:
        imports.insert(0, "import torch")
    data["tf32"] = plan.tf32
    data["dataloader_batch_size"] = micro
    comments = _dataloader_line(micro, accum, f"the {cls}" if trainer else cls)
    if trainer:
        if accum > 1:
            kwargs["accumulate_grad_batches"] = accum
        if policy.grad_clip_norm is not None:
            kwargs["gradient_clip_val"] = float(policy.grad_clip_norm)
            kwargs["gradient_clip_algorithm"] = "norm"
        data["trainer"] = {k: v for k, v in kwargs.items() if k not in ("precision", "plugins")}
    else:
        data["accumulate"] = accum
        data["clip_grad_norm"] = policy.grad_clip_norm
        if accum > 1:
            comments += _comment(
                f"Fabric leaves accumulation to the loop: step the optimizer every {accum} batches, with "
                f"fabric.backward(loss / {accum}) and fabric.no_backward_sync(model, enabled=not stepping)."
            )
        if policy.grad_clip_norm is not None:
            comments += _comment(
                f"Clip as the policy does: fabric.clip_gradients(model, optimizer, "
                f"max_norm={policy.grad_clip_norm:g}) before optimizer.step()."
            )
    build = [*comments, f"# Pass these arguments to your {cls}(...).", *_call(f"{cls.lower()} = {cls}", kwargs)]
    return job.done(_code(job.header(), imports, scaler_class, scaler, switches, build), "python", data)


# ---- the Hugging Face Trainer ---------------------------------------------------------------


def _transformers(job: _Job) -> Export:
    policy = job.policy
    job.check_framework()
    ls = policy.loss_scale
    if policy.mode == "fp16-mixed" and ls is not None and ls.kind == "none":
        # The traits pass a policy without loss scaling, yet fp16=True always builds a GradScaler.
        raise job.refuse(
            "the HF Trainer scales every fp16 loss with a dynamic GradScaler, and the policy has no loss scaling"
        )
    if policy.mode == "fp16-mixed" and job.device == "cpu":
        raise job.refuse(
            "on a CPU the HF Trainer's Accelerate turns neither fp16 autocast nor a GradScaler on, so fp16=True "
            "would train in fp32"
        )
    micro, accum = job.split()
    job.reduce_dtype_warning()
    fields: dict[str, Any] = dict(TRANSFORMERS_PRECISION[policy.mode])
    if micro is not None:
        fields["per_device_train_batch_size"] = micro
    fields["gradient_accumulation_steps"] = accum
    # Only a policy that clips sets max_grad_norm: the trials kept the script's own value
    # (TrainingArguments' default clips at 1.0), so leaving it out exports what was measured.
    if policy.grad_clip_norm is not None:
        fields["max_grad_norm"] = float(policy.grad_clip_norm)
    body = [
        "# Pass these fields to TrainingArguments: TrainingArguments(output_dir=..., **training_arguments).",
        "training_arguments = {",
        *(f"    {_py(k)}: {_py(v)}," for k, v in fields.items()),
        "}",
    ]
    return job.done(_code(job.header(), body), "python", {"training_arguments": fields})


# ---- Accelerate -------------------------------------------------------------------------------


def _accelerate(job: _Job) -> Export:
    policy = job.policy
    # Accelerate does not own the batch either (the script's DataLoader does).
    # The batch split and clipping are the script's here: the export says how to set them in it.
    job.check_framework(policy.with_(micro_batch_size=None, grad_accum_steps=None, grad_clip_norm=None))
    micro, accum = job.split()
    job.reduce_dtype_warning()
    if policy.mode == "fp8-torchao" and job.device == "cpu":
        raise job.refuse(
            "on a CPU Accelerate runs FP8 under bf16 autocast, where mpadvise's CPU emulation runs the "
            "other layers in fp32"
        )
    if policy.mode == "fp8-te" and job.device != "cuda":
        raise job.refuse("Transformer Engine runs on CUDA only")
    try:
        settings = accelerate_settings(policy)
    except MpadviseError as exc:
        raise job.refuse(str(exc)) from None
    config_file: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "NO",
        "num_processes": 1,
        "mixed_precision": settings.mixed_precision,
        "use_cpu": job.device == "cpu",
        "debug": False,
    }
    stdlib: list[str] = []
    imports = ["from accelerate import Accelerator"]
    utils: list[str] = []
    fp8_layers: list[list[str]] = []
    handlers: list[str] = []
    handler_data: list[dict[str, Any]] = []
    if settings.grad_scaler is not None:
        utils.append("GradScalerKwargs")
        handlers += _call("GradScalerKwargs", settings.grad_scaler, indent="    ")
        handler_data.append({"class": "GradScalerKwargs", "kwargs": dict(settings.grad_scaler)})
    if settings.te_recipe is not None:
        utils.append("TERecipeKwargs")
        config_file["fp8_config"] = {"backend": "TE"}
        handlers += _call("TERecipeKwargs", settings.te_recipe, indent="    ")
        handler_data.append({"class": "TERecipeKwargs", "kwargs": dict(settings.te_recipe)})
        multiple = _te_dim_multiple(policy)
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
        utils.append("AORecipeKwargs")
        config_file["fp8_config"] = {"backend": "AO"}
        recipe = settings.torchao_recipe
        rule = Fp8Torchao.recipe_rule(recipe)
        pad = rule.token_multiple > 1
        stdlib.append("import dataclasses")
        fp8_layers.append([
            "def fp8_layer_filter(module: torch.nn.Module, fqn: str) -> bool:",
            f'    """The layers mpadvise runs in FP8: each Linear with features multiples of {rule.dim_multiple}."""',
            "    return (",
            "        isinstance(module, torch.nn.Linear)",
            f"        and module.in_features % {rule.dim_multiple} == 0",
            f"        and module.out_features % {rule.dim_multiple} == 0",
            "    )",
        ])
        config_lines = [f"fp8_config = Float8LinearConfig.from_recipe_name({_py(recipe)})"]
        if pad:
            config_lines += ["# torch._scaled_mm wants the token count a multiple of 16: pad with zero rows (exact).",
                             "fp8_config = dataclasses.replace(fp8_config, pad_inner_dim=True)"]
        fp8_layers.append(config_lines)
        handlers += ["    AORecipeKwargs(config=fp8_config, module_filter_func=fp8_layer_filter),"]
        handler_data.append({
            "class": "AORecipeKwargs", "recipe": recipe, "pad_inner_dim": pad,
            "module_filter": f"torch.nn.Linear with in and out features multiples of {rule.dim_multiple}",
        })
    if utils:
        imports.append(f"from accelerate.utils import {', '.join(utils)}")
    if settings.torchao_recipe is not None:
        imports.append("from torchao.float8 import Float8LinearConfig")
    tf32 = settings.tf32
    switches = [] if tf32 is None else _tf32_lines(tf32, cuda=job.device == "cuda", mode=policy.mode)
    cpu_fp16 = settings.mixed_precision == "fp16" and job.device == "cpu"
    if switches or fp8_layers or cpu_fp16:
        imports.insert(0, "import torch")
    yaml_text = _yaml(config_file)
    config_comment = [
        "# The same precision as an accelerate config file, for `accelerate launch --config_file FILE`",
        "# (merge mixed_precision and fp8_config into your own for more processes or machines):",
        *(f"#   {line}" for line in yaml_text.splitlines()),
    ]
    build = _dataloader_line(micro, accum, "the Accelerator")
    accelerator_kwargs: dict[str, Any] = {"mixed_precision": settings.mixed_precision}
    if accum > 1:
        accelerator_kwargs["gradient_accumulation_steps"] = accum
        build += _comment(f"Run each micro-batch under `with accelerator.accumulate(model):`; it steps every {accum}.")
    if policy.grad_clip_norm is not None:
        build += _comment(
            f"Clip as the policy does: accelerator.clip_grad_norm_(model.parameters(), {policy.grad_clip_norm:g}) "
            "before optimizer.step()."
        )
    if handlers:
        build += ["kwargs_handlers = [", *_closed(handlers), "]"]
        accelerator_kwargs["kwargs_handlers"] = _Code("kwargs_handlers")
    build += _call("accelerator = Accelerator", accelerator_kwargs)
    if cpu_fp16:
        # What the Accelerate adapter does in a trial on a CPU.
        scaler = settings.grad_scaler or {}
        build += [
            "# On a CPU Accelerate turns neither fp16 autocast nor a GradScaler on (it would train in fp32):",
            "# turn them on, as mpadvise's trials do.",
            *_call("accelerator.scaler = torch.amp.GradScaler", scaler, args=("cpu",)),
            "accelerator.native_amp = True",
        ]
    data = {
        "config_file": config_file,
        "config_file_yaml": yaml_text,
        "accelerator": {k: v for k, v in accelerator_kwargs.items() if k != "kwargs_handlers"},
        "kwargs_handlers": handler_data,
        "tf32": tf32,
        "dataloader_batch_size": micro,
        "clip_grad_norm": policy.grad_clip_norm,
    }
    return job.done(_code(job.header(), stdlib, imports, *fp8_layers, switches, config_comment, build), "python", data)


def _closed(handler_lines: list[str]) -> list[str]:
    """Handler calls as list items: the closing line of a multi-line call gets the comma."""
    return [line + "," if line.strip() == ")" else line for line in handler_lines]


def _te_dim_multiple(policy: Policy) -> int:
    """The feature multiple at which mpadvise's fp8-te swaps a Linear, for the policy's recipe."""
    return Fp8Te.recipe_rule(Fp8Te.policy_recipe(policy)).dim_multiple


def _yaml(mapping: Mapping[str, Any], indent: str = "") -> str:
    """A small YAML writer for the accelerate config file (flat keys, one nested level)."""
    lines = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            lines.append(f"{indent}{key}:")
            lines.append(_yaml(value, indent + "  ").rstrip("\n"))
        elif isinstance(value, bool):
            lines.append(f"{indent}{key}: {'true' if value else 'false'}")
        elif isinstance(value, str):
            # 'NO' and 'no' are booleans to YAML 1.1 readers: quote every string.
            lines.append(f"{indent}{key}: '{value}'")
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines) + "\n"


# ---- DeepSpeed --------------------------------------------------------------------------------


def _deepspeed(job: _Job) -> Export:
    policy = job.policy
    mode = policy.mode
    # DeepSpeed's "fp16" and "bf16" sections cast the model to 16 bits and keep fp32 master
    # weights (Apex's O2): every operation runs in half precision, softmax, norms and the loss
    # included, where the policy's -mixed modes run torch.autocast over fp32 weights and keep
    # those in fp32. That is not a bounded difference (fp16 softmax or norms can overflow where
    # the trial never did), so the -mixed modes go through DeepSpeed's "torch_autocast" section,
    # which is autocast over fp32 weights, with torch's GradScaler for fp16. The "-true" modes
    # are refused: DeepSpeed's 16-bit sections always keep fp32 masters and optimizer state
    # (bf16 masters need ZeRO and an optimizer layout an export does not choose).
    if mode in ("fp16-true", "bf16-true"):
        raise job.refuse(
            "DeepSpeed's fp16 and bf16 training keeps fp32 master weights and optimizer state, so it is not "
            "pure 16-bit training (memory and speed differ from what was measured)"
        )
    if mode not in ("fp32", "tf32", "fp16-mixed", "bf16-mixed"):
        raise job.refuse(
            f"DeepSpeed's config has no {mode} training (it can express fp32, tf32, fp16-mixed and bf16-mixed)"
        )
    if job.device == "cpu" and mode == "fp16-mixed":
        raise job.refuse("DeepSpeed's torch_autocast builds its GradScaler for the accelerator's device, not a CPU")
    ls = policy.loss_scale
    if mode == "fp16-mixed" and ls is not None:
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
    micro, accum = job.split()
    job.reduce_dtype_warning()
    config: dict[str, Any] = {}
    notes: list[str] = []
    if micro is not None:
        config["train_micro_batch_size_per_gpu"] = micro
    else:
        notes.append("add train_micro_batch_size_per_gpu (the script's batch size per GPU): DeepSpeed requires it, "
                     "and the policy keeps the script's batch")
    config["gradient_accumulation_steps"] = accum
    # DeepSpeed clips at 1.0 unless told (GRADIENT_CLIPPING_DEFAULT), and 0.0 turns it off.
    config["gradient_clipping"] = float(policy.grad_clip_norm) if policy.grad_clip_norm is not None else 0.0
    config["fp16"] = {"enabled": False}
    config["bf16"] = {"enabled": False}
    if mode in DEEPSPEED_AUTOCAST_SINCE:
        # An empty lower_precision_safe_modules keeps every gradient's reduction in fp32, as
        # DDP does under autocast; DeepSpeed's default list would reduce Linear and Conv
        # gradients in 16 bits.
        config["torch_autocast"] = {"enabled": True, "dtype": "float16" if mode == "fp16-mixed" else "bfloat16",
                                    "lower_precision_safe_modules": []}
        notes.append(f"needs DeepSpeed {DEEPSPEED_AUTOCAST_SINCE[mode]} or newer for torch_autocast; an older one "
                     "ignores the section and trains in fp32")
    tf32 = _tf32_of(mode)
    if tf32 is False:
        job.warn(
            "deepspeed-tf32",
            "DeepSpeed's config has no TF32 switch, and torch runs cuDNN convolutions in TF32 by default: for exact "
            "fp32 set torch.backends.cudnn.allow_tf32 = False in the script (and on torch >= 2.9 "
            'torch.backends.cudnn.conv.fp32_precision = "ieee"), as `mpadvise export --to lightning` writes',
        )
    elif tf32 is True:
        job.warn(
            "deepspeed-tf32",
            "DeepSpeed's config has no TF32 switch: set torch.set_float32_matmul_precision(\"high\") in the script "
            "(and the cuDNN switches, as `mpadvise export --to lightning` writes), or fp32 matmuls run in IEEE "
            "fp32: slower, not less precise",
        )
    text = json.dumps(config, indent=2)
    return Export(job.target, text + "\n", "json", {"config": config}, tuple(job.warnings), tuple(notes))


# ---- torchtitan -------------------------------------------------------------------------------


def _torchtitan(job: _Job) -> Export:
    policy = job.policy
    mode = policy.mode
    if mode in ("fp16-mixed", "fp16-true"):
        raise job.refuse(
            "torchtitan has no fp16 training (training.dtype and mixed_precision_param take bfloat16 or float32)"
        )
    if mode == "fp8-te":
        raise job.refuse("torchtitan has no Transformer Engine path; its FP8 is torchao's (fp8-torchao)")
    if mode not in ("fp32", "tf32", "bf16-mixed", "bf16-true", "fp8-torchao"):
        raise job.refuse(f"torchtitan has no {mode} training")
    training: dict[str, Any] = {
        "dtype": "bfloat16" if mode == "bf16-true" else "float32",
        # torchtitan applies the parameter dtype as FSDP2's MixedPrecisionPolicy when it shards
        # and as torch.autocast otherwise: what mpadvise's bf16-mixed does in either case.
        "mixed_precision_param": "float32" if mode in ("fp32", "tf32") else "bfloat16",
        "mixed_precision_reduce": "float32",
        # torchtitan always clips, at 1.0 by default: an infinite norm clips nothing (the
        # gradients are multiplied by exactly 1).
        "max_norm": float(policy.grad_clip_norm) if policy.grad_clip_norm is not None else math.inf,
    }
    float8: dict[str, Any] | None = None
    if mode == "fp8-torchao":
        recipe = Fp8Torchao.policy_recipe(policy)
        if recipe == "tensorwise":
            raise job.refuse(
                "torchtitan's Float8LinearConverter offers the rowwise and rowwise_with_gw_hp recipes only, not "
                "tensorwise; set [fp8] recipe to one of those and tune it"
            )
        # torchtitan's module_filter_fn converts each Linear whose dimensions are multiples of
        # 16, less filter_fqns: with none, mpadvise's filter.
        float8 = {"recipe_name": recipe, "filter_fqns": []}
    if mode == "bf16-true":
        job.warn(
            "torchtitan-bf16-fp32-logits",
            "torchtitan's bf16 training keeps RoPE and the logits in fp32, where mpadvise's bf16-true runs them in "
            "bf16: more precise there, slightly slower",
        )
    reduce = policy.reduce_dtype or default_reduce_dtype(mode)
    if reduce != "fp32":
        job.warn(
            "torchtitan-reduce-fp32",
            f"torchtitan reduces gradients across ranks in float32 (its only choice), where the policy reduces in "
            f"{reduce} under FSDP2: more precise, twice the reduce-scatter bytes",
        )
    micro, accum = job.split()
    tf32 = _tf32_of(mode)
    about = ["# torchtitan's Python config (Trainer.Config): apply the function to the config your recipe returns.",
             "# (torchtitan 0.2 and earlier read the same [training] fields from a TOML job config.)"]
    imports = (["import torch"] if tf32 is not None else []) + (
        ["from torchtitan.components.quantization import Float8LinearConverter"] if float8 is not None else [])
    switches = [] if tf32 is None else _tf32_lines(tf32, cuda=job.device == "cuda", mode=mode)
    converter = [] if float8 is None else [
        f"# FP8 ({float8['recipe_name']}) on each Linear whose dimensions are multiples of 16, as mpadvise converts;",
        "# give it to the model: model_registry(flavor, converters=[FLOAT8_CONVERTER]).",
        f"FLOAT8_CONVERTER = Float8LinearConverter.Config(recipe_name={_py(float8['recipe_name'])}, filter_fqns=[])",
    ]
    signature = "config, data_parallel_degree=1" if accum > 1 else "config"
    function = [f"def apply_mpadvise_policy({signature}):",
                f'    """The policy {policy.describe()} on a torchtitan Trainer.Config."""']
    function += [f"    config.training.{key} = {_py(value)}" for key, value in training.items()]
    if micro is not None:
        function += [f"    # micro-batch {micro} sequences per data-parallel rank, in input-token slots",
                     f"    micro_tokens = {micro} * config.training.max_context_length",
                     "    config.training.num_tokens_per_microbatch_per_dp_rank = micro_tokens"]
    if accum > 1:
        if micro is None:
            function += ["    # the config's own micro-batch",
                         "    micro_tokens = config.training.num_tokens_per_microbatch_per_dp_rank"]
        function += [f"    # {accum} micro-batches per optimizer step on each data-parallel rank",
                     f"    config.training.num_tokens_per_train_step = micro_tokens * {accum} * data_parallel_degree"]
    function.append("    return config")
    data = {"training": training, "float8": float8, "tf32": tf32, "micro_batch_size": micro, "grad_accum_steps": accum}
    return job.done(_code([*job.header(), *about], imports, switches, converter, function), "python", data)


class LightningExporter(Exporter):
    target = "lightning"
    title = "the Lightning Trainer"

    def write(self, job: _Job) -> Export:
        return _lightning(job)


class FabricExporter(Exporter):
    target = "fabric"
    title = "Lightning Fabric"

    def write(self, job: _Job) -> Export:
        return _lightning(job)


class TransformersExporter(Exporter):
    target = "transformers"
    title = "the Hugging Face Trainer"

    def write(self, job: _Job) -> Export:
        return _transformers(job)


class AccelerateExporter(Exporter):
    target = "accelerate"
    title = "Accelerate"

    def write(self, job: _Job) -> Export:
        return _accelerate(job)


class DeepSpeedExporter(Exporter):
    target = "deepspeed"
    title = "DeepSpeed"

    def write(self, job: _Job) -> Export:
        return _deepspeed(job)


class TorchtitanExporter(Exporter):
    target = "torchtitan"
    title = "torchtitan"

    def write(self, job: _Job) -> Export:
        return _torchtitan(job)


EXPORTERS: Mapping[str, type[Exporter]] = {cls.target: cls for cls in (
    LightningExporter, FabricExporter, TransformersExporter, AccelerateExporter, DeepSpeedExporter,
    TorchtitanExporter)}
# The frameworks mpadvise tunes through, whose traits judge an export.
_TUNED_FRAMEWORKS = ("lightning", "fabric", "transformers", "accelerate")
