"""Export to DeepSpeed: its JSON config, with the policy's batch, clipping and
``torch_autocast``, read from the mode's facts.
"""

from __future__ import annotations

import json
from typing import Any

from advisor.frameworks._adapter import TORCH_DTYPE, scaler_kwargs
from advisor.frameworks._export import Export, Exporter, _Job
from policies import LossScale

# DeepSpeed runs torch.autocast from its "torch_autocast" section: bf16 since 0.17.2; fp16 with
# a GradScaler at every ZeRO stage since 0.18.0 (read in the sources of those releases). An
# older DeepSpeed ignores the section and trains in fp32.
DEEPSPEED_AUTOCAST_SINCE = {"bf16": "0.17.2", "fp16": "0.18.0"}

# DeepSpeed's config has no TF32 switch: what the script must set for each of the mode's choices.
_TF32_GAP = {
    False: "DeepSpeed's config has no TF32 switch, and torch runs cuDNN convolutions in TF32 by default: for "
           "exact fp32 set torch.backends.cudnn.allow_tf32 = False in the script (and on torch >= 2.9 "
           'torch.backends.cudnn.conv.fp32_precision = "ieee"), as `mpadvise export --to lightning` writes',
    True: "DeepSpeed's config has no TF32 switch: set torch.set_float32_matmul_precision(\"high\") in the "
          "script (and the cuDNN switches, as `mpadvise export --to lightning` writes), or fp32 matmuls run "
          "in IEEE fp32: slower, not less precise",
}


class DeepSpeedExporter(Exporter):
    target = "deepspeed"
    title = "DeepSpeed"

    def write(self, job: _Job) -> Export:
        self._check(job)
        split = job.split
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
        config.update(fp16={"enabled": False}, bf16={"enabled": False})
        if facts.autocast is not None:
            # An empty lower_precision_safe_modules keeps every gradient's reduction in fp32, as
            # DDP does under autocast; DeepSpeed's default list would reduce Linear and Conv
            # gradients in 16 bits.
            config["torch_autocast"] = {"enabled": True, "dtype": TORCH_DTYPE[facts.autocast],
                                        "lower_precision_safe_modules": []}
            job.notes.append(f"needs DeepSpeed {DEEPSPEED_AUTOCAST_SINCE[facts.autocast]} or newer for "
                             "torch_autocast; an older one ignores the section and trains in fp32")
        if facts.tf32 is not None:
            job.warn("deepspeed-tf32", _TF32_GAP[facts.tf32])
        text = json.dumps(config, indent=2) + "\n"
        return Export(job.target, text, "json", {"config": config}, tuple(job.warnings), tuple(job.notes))

    @staticmethod
    def _check(job: _Job) -> None:
        policy, facts = job.policy, job.facts
        # DeepSpeed's "fp16"/"bf16" sections run every operation in half precision over fp32
        # masters (Apex's O2), not autocast: -mixed modes go through "torch_autocast" instead.
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
        default = scaler_kwargs(LossScale())
        changed = [name for name, value in scaler_kwargs(ls).items() if value != default[name]]
        if ls.kind == "static" or changed:
            what = "a static loss scale" if ls.kind == "static" else f"GradScaler's {', '.join(changed)}"
            raise job.refuse(
                f"DeepSpeed's torch_autocast builds torch.amp.GradScaler with its defaults (dynamic, initial scale "
                f"65536, growth interval 2000) and cannot apply {what}; its fp16 section, which takes loss-scale "
                "settings, trains fp16 weights with fp32 masters, not autocast"
            )

