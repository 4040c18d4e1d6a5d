"""Export to the Lightning Trainer and Fabric: a precision string or plugin code, accumulation
and clipping, from the Lightning adapter's own plan (``lightning_precision``).
"""

from __future__ import annotations

from typing import Any

from advisor.frameworks._adapter import scaler_kwargs
from advisor.frameworks._export import Export, Exporter, _call, _Code, _comment, _Job, _py
from advisor.frameworks._lightning import (
    LightningPrecision,
    lightning_precision,
    transformer_engine_args,
)
from policies import LossScale

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


class LightningExporter(Exporter):
    target = "lightning"
    title = "the Lightning Trainer"
    package = "lightning.pytorch"
    cls = "Trainer"
    script_sets_batch = True

    def write(self, job: _Job) -> Export:
        policy = job.policy
        split = job.split
        job.reduce_dtype_warning()
        plan = lightning_precision(policy)
        imports = [f"from {self.package} import {self.cls}"]
        kwargs: dict[str, Any] = {}
        data: dict[str, Any] = {"precision": None, "plugin": None}
        setup = self._precision(job, plan, imports, kwargs, data)
        switches = job.tf32_lines(plan.tf32)
        if setup or switches:
            imports.insert(0, "import torch")
        data["tf32"] = plan.tf32
        data["dataloader_batch_size"] = split.micro if split is not None else None
        comments = job.dataloader_line(f"the {self.cls}") + self._loop(job, kwargs, data)
        build = [*comments, f"# Pass these arguments to your {self.cls}(...).",
                 *_call(f"{self.cls.lower()} = {self.cls}", kwargs)]
        return job.python(imports, *setup, switches, build, data=data)

    def _precision(self, job: _Job, plan: LightningPrecision, imports: list[str], kwargs: dict[str, Any],
                   data: dict[str, Any]) -> list[list[str]]:
        """The precision argument (in ``kwargs``) and the blocks that build its plugin."""
        package = self.package
        if plan.plugin == "amp":
            # What the Lightning adapter applies to fp16-mixed (``LightningPrecision`` says why).
            ls, device = plan.loss_scale or LossScale(), job.device
            imports.append(f"from {package}.plugins import MixedPrecision")
            kwargs["plugins"] = _Code(f"[MixedPrecision('16-mixed', {_py(device)}, scaler=scaler)]")
            data["plugin"] = {"class": "MixedPrecision", "precision": "16-mixed", "device": device,
                              "scaler": {"kind": ls.kind, **scaler_kwargs(ls)}}
            if ls.kind == "static":
                scaler = [f"scaler = StaticGradScaler({_py(device)}, {_py(float(ls.init_scale))})"]
            elif ls.kind == "none":
                scaler = [f"scaler = torch.amp.GradScaler({_py(device)}, enabled=False)"
                          "  # no loss scaling"]
            else:
                scaler = _call("scaler = torch.amp.GradScaler", scaler_kwargs(ls), args=(device,))
            return [_STATIC_SCALER if ls.kind == "static" else [], scaler]
        if plan.plugin == "transformer-engine":
            if not job.cuda:
                raise job.refuse("Transformer Engine runs on CUDA only")
            te = transformer_engine_args(job.policy)
            imports.append(f"from {package}.plugins import TransformerEnginePrecision")
            plugin = _call("plugin = TransformerEnginePrecision", {
                "weights_dtype": _Code(f"torch.{te['weights_dtype']}"),
                "fallback_compute_dtype": _Code(f"torch.{te['fallback_compute_dtype']}"),
                "recipe": te["recipe"],
            })
            kwargs["plugins"] = _Code("[plugin]")
            data["plugin"] = {"class": "TransformerEnginePrecision", **te}
            # Lightning's layer swap is its _convert_layers; TE's FP8 GEMM wants the input's last dim % 16.
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

    def _loop(self, job: _Job, kwargs: dict[str, Any], data: dict[str, Any]) -> list[str]:
        """Accumulation and clipping: the Trainer's arguments (Fabric's override says how)."""
        clip = job.policy.grad_clip_norm
        if job.split is not None:
            kwargs["accumulate_grad_batches"] = job.split.accum
        if clip is not None:
            kwargs["gradient_clip_val"] = float(clip)
            kwargs["gradient_clip_algorithm"] = "norm"
        data["trainer"] = {k: v for k, v in kwargs.items() if k not in ("precision", "plugins")}
        return []


class FabricExporter(LightningExporter):
    target = "fabric"
    title = "Lightning Fabric"
    package = "lightning.fabric"
    cls = "Fabric"

    def _loop(self, job: _Job, kwargs: dict[str, Any], data: dict[str, Any]) -> list[str]:
        clip = job.policy.grad_clip_norm
        accum = job.split.accum if job.split is not None else None
        data.update(accumulate=accum, clip_grad_norm=clip)
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
