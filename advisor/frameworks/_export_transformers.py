"""Export to the Hugging Face Trainer: ``TrainingArguments`` fields, from the adapter's own
precision fields (``transformers_precision``).
"""

from __future__ import annotations

from typing import Any

from advisor.frameworks._export import Export, Exporter, _Job, _py
from advisor.frameworks._transformers import transformers_precision


class TransformersExporter(Exporter):
    target = "transformers"
    title = "the Hugging Face Trainer"

    def write(self, job: _Job) -> Export:
        policy, facts = job.policy, job.facts
        # The traits refused fp16 without loss scaling (fp16=True always builds a GradScaler) and
        # fp16 autocast on a CPU (Accelerate turns neither autocast nor a GradScaler on there).
        if facts.tf32 and not job.cuda:
            raise job.refuse("TrainingArguments(tf32=True) needs an Ampere or newer GPU; on a CPU it raises")
        split = job.split
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
