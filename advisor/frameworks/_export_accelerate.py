"""Export to Accelerate: code that builds the ``Accelerator`` with its kwargs handlers, or its
YAML config file, from the adapter's own settings (``accelerate_settings``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from advisor.frameworks._accelerate import AccelerateSettings, accelerate_settings
from advisor.frameworks._adapter import scaler_kwargs
from advisor.frameworks._export import Export, Exporter, _call, _Code, _comment, _Job, _py
from policies import Fp8Te, Fp8Torchao, LossScale


class AccelerateExporter(Exporter):
    target = "accelerate"
    title = "Accelerate"
    script_sets_batch = True

    def write(self, job: _Job) -> Export:
        policy, facts = job.policy, job.facts
        split = job.split
        job.reduce_dtype_warning()
        if facts.fp8_library is not None and not job.cuda:
            raise job.refuse(
                "on a CPU Accelerate runs FP8 under bf16 autocast, where mpadvise's CPU emulation runs the "
                "other layers in fp32" if facts.fp8_library == "torchao"
                else "Transformer Engine runs on CUDA only")
        settings = accelerate_settings(policy)  # what the traits passed, Accelerate can build
        config_file: dict[str, Any] = {
            "compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_processes": 1,
            "mixed_precision": settings.mixed_precision, "use_cpu": not job.cuda, "debug": False,
        }
        if settings.te_recipe is not None or settings.torchao_recipe is not None:
            config_file["fp8_config"] = {"backend": "TE" if settings.te_recipe is not None else "AO"}
        # PyYAML comes with Accelerate, which reads this file; its safe writer quotes what YAML
        # 1.1 would read as a bool ('no').
        import yaml

        yaml_text = yaml.safe_dump(dict(config_file), sort_keys=False, default_flow_style=False)
        code = _AccelerateCode(job, settings)
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
        return dataclasses.replace(
            export, alternates={"yaml": self._yaml_export(job, settings, config_file, yaml_text)})

    @staticmethod
    def _yaml_export(job: _Job, settings: AccelerateSettings, config_file: dict[str, Any],
                     yaml_text: str) -> Export | str:
        """The config file alone, for ``accelerate launch --config_file``; or why it cannot carry the policy."""
        needs_code = []
        if settings.grad_scaler is not None and settings.grad_scaler != scaler_kwargs(LossScale()):
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
        notes, split = [], job.split
        if split is not None and split.micro is not None:
            notes.append(f"set the DataLoader's batch_size to {split.micro}, the policy's micro-batch")
        if split is not None and split.accum > 1:
            notes.append(f"pass gradient_accumulation_steps={split.accum} to Accelerator(...) and run each "
                         "micro-batch under `with accelerator.accumulate(model):`")
        if job.policy.grad_clip_norm is not None:
            notes.append(f"clip as the policy does: accelerator.clip_grad_norm_(model.parameters(), "
                         f"{float(job.policy.grad_clip_norm)!r}) before optimizer.step()")
        return Export(job.target, yaml_text, "yaml", {"config_file": config_file}, tuple(job.warnings), tuple(notes))


class _AccelerateCode:
    """The Python of an Accelerate export, block by block: imports, FP8 layers, switches, the build."""

    def __init__(self, job: _Job, settings: AccelerateSettings) -> None:
        self.stdlib: list[str] = []
        self.imports = ["from accelerate import Accelerator"]
        self.fp8_layers: list[list[str]] = []
        self.handlers: list[str] = []
        self.handler_data: list[dict[str, Any]] = []
        self._handlers(job, settings)
        if self.handler_data:
            utils = ", ".join(handler["class"] for handler in self.handler_data)
            self.imports.append(f"from accelerate.utils import {utils}")
        if settings.torchao_recipe is not None:
            self.imports.append("from torchao.float8 import Float8LinearConfig")
        self.switches = job.tf32_lines(settings.tf32)
        cpu_fp16 = settings.mixed_precision == "fp16" and not job.cuda
        if self.switches or self.fp8_layers or cpu_fp16:
            self.imports.insert(0, "import torch")
        self.accelerator: dict[str, Any] = {"mixed_precision": settings.mixed_precision}
        self.build = self._build(job, settings, cpu_fp16)

    def _handlers(self, job: _Job, settings: AccelerateSettings) -> None:
        for handler, kwargs in (("GradScalerKwargs", settings.grad_scaler),
                                ("TERecipeKwargs", settings.te_recipe)):
            if kwargs is not None:
                self.handlers += _call(handler, kwargs, indent="    ")
                self.handler_data.append({"class": handler, "kwargs": dict(kwargs)})
        if settings.te_recipe is not None:
            multiple = Fp8Te.recipe_rule(Fp8Te.policy_recipe(job.policy)).dim_multiple
            # accelerate/utils/transformer_engine.py, convert_model (1.15): a `return` inside its loop.
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

    def _build(self, job: _Job, settings: AccelerateSettings, cpu_fp16: bool) -> list[str]:
        build, split = job.dataloader_line("the Accelerator"), job.split
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
            # As list items: the closing line of a multi-line call gets the comma.
            items = [line + "," if line.strip() == ")" else line for line in self.handlers]
            build += ["kwargs_handlers = [", *items, "]"]
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
