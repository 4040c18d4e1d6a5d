"""Export to torchtitan: a function that sets the policy on its ``Trainer.Config`` (torchtitan
0.3), read from the mode's facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from advisor.frameworks._adapter import TORCH_DTYPE
from advisor.frameworks._export import Export, Exporter, _call, _Job, _py
from policies import default_reduce_dtype


class TorchtitanExporter(Exporter):
    target = "torchtitan"
    title = "torchtitan"

    def write(self, job: _Job) -> Export:
        facts = job.facts
        float8 = self._check(job)
        training: dict[str, Any] = {
            "dtype": TORCH_DTYPE[facts.weights],
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
        split = job.split
        if split is None:
            job.notes.append("training.local_batch_size and global_batch_size stay as the config sets them: the "
                             "policy keeps the script's batch")
        switches = job.tf32_lines(facts.tf32)
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
        return job.python(about, imports, switches, converter, self._function(job, training), data=data)

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
    def _function(job: _Job, training: Mapping[str, Any]) -> list[str]:
        """``apply_mpadvise_policy(config, ...)``: the training fields, then the batch the policy sets."""
        split = job.split
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
