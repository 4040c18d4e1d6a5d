"""The Hugging Face Trainer adapter's decisions: which TrainingArguments fields apply a policy,
and when the Trainer did not run what the policy asks (pure: transformers is not imported)."""

from __future__ import annotations

import pytest

from advisor.frameworks._transformers import (
    TRIAL_ARGUMENTS,
    accelerator_mismatch,
    argument_changes,
    autocast_mismatch,
    scaler_skipped,
)
from policies import Policy, TunedOn

SCRIPT = {"fp16": False, "bf16": False, "tf32": None, "per_device_train_batch_size": 32,
          "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "data_seed": None,
          "lr_scheduler_type": "linear", "use_cpu": False}


def test_the_policy_precision_replaces_the_scripts():
    changes = argument_changes(Policy(mode="bf16-mixed"), {**SCRIPT, "fp16": True}, trial=False)
    assert changes.values == {"fp16": False, "bf16": True, "tf32": False}
    assert changes.notes == ("TrainingArguments(fp16=False, bf16=True, tf32=False) for bf16-mixed "
                             "where the script's arguments had fp16=True, bf16=False",)
    fp32 = argument_changes(Policy(mode="fp32"), {**SCRIPT, "tf32": True}, trial=False)
    assert fp32.values == {"fp16": False, "bf16": False, "tf32": False}
    assert fp32.notes[0].endswith("where the script's arguments had tf32=True")
    # A CPU run needs use_cpu for bf16=True: the Trainer refuses bf16 where it sees no bf16 GPU.
    assert argument_changes(Policy(mode="bf16-mixed"), SCRIPT, trial=False, use_cpu=True).values["use_cpu"] is True
    assert "use_cpu" not in argument_changes(Policy(mode="bf16-mixed"), {**SCRIPT, "use_cpu": True}, trial=False,
                                             use_cpu=True).values


def test_a_micro_batch_split_keeps_the_scripts_global_batch():
    changes = argument_changes(Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4), SCRIPT, trial=True)
    assert changes.values["per_device_train_batch_size"] == 16
    assert changes.values["gradient_accumulation_steps"] == 4
    assert changes.user_batch == 64 and changes.split is not None and not changes.split.warning
    assert ("per_device_train_batch_size=16, gradient_accumulation_steps=4 over the script's 32 x 2: "
            "global batch 64 kept") in changes.notes
    # Without a split in the policy the script's own batch and accumulation stay as written.
    plain = argument_changes(Policy(mode="bf16-mixed"), SCRIPT, trial=True)
    assert "per_device_train_batch_size" not in plain.values and "gradient_accumulation_steps" not in plain.values
    assert plain.user_batch == 64 and plain.split is None


def test_a_tuned_split_on_another_batch_splits_the_scripts_batch_with_a_warning():
    tuned = Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4,
                   tuned_on=TunedOn(hardware_fingerprint="x", global_batch=64))
    changes = argument_changes(tuned, {**SCRIPT, "per_device_train_batch_size": 64}, trial=False)
    assert (changes.values["per_device_train_batch_size"], changes.values["gradient_accumulation_steps"]) == (16, 8)
    assert changes.split.warning and "differs from the global batch 64" in changes.split.note


def test_a_trial_turns_off_what_only_slows_it():
    trial = argument_changes(Policy(mode="fp32"), SCRIPT, trial=True)
    assert {k: trial.values[k] for k in TRIAL_ARGUMENTS} == dict(TRIAL_ARGUMENTS)
    assert trial.values["logging_nan_inf_filter"] is False and trial.values["eval_strategy"] == "no"
    assert any(note.startswith("trial settings: logging_nan_inf_filter=False") for note in trial.notes)
    # A scheduler that steps on evaluation metrics keeps its evaluation.
    plateau = argument_changes(Policy(mode="fp32"), {**SCRIPT, "lr_scheduler_type": "reduce_lr_on_plateau"}, trial=True)
    assert "eval_strategy" not in plateau.values
    run = argument_changes(Policy(mode="fp32"), SCRIPT, trial=False)
    assert not set(run.values) & (set(TRIAL_ARGUMENTS) | {"eval_strategy"})


def test_the_trial_seed_shifts_an_explicit_data_seed_and_clipping_follows_the_policy():
    assert argument_changes(Policy(mode="fp32"), {**SCRIPT, "data_seed": 7}, trial=True, seed_shift=1).values["data_seed"] == 8
    assert "data_seed" not in argument_changes(Policy(mode="fp32"), {**SCRIPT, "data_seed": 7}, trial=True).values
    assert "data_seed" not in argument_changes(Policy(mode="fp32"), SCRIPT, trial=True, seed_shift=1).values
    clipped = argument_changes(Policy(mode="fp32", grad_clip_norm=0.5), SCRIPT, trial=False)
    assert clipped.values["max_grad_norm"] == 0.5
    assert "max_grad_norm" not in argument_changes(Policy(mode="fp32"), SCRIPT, trial=False).values


@pytest.mark.parametrize(
    ("mode", "enabled", "dtype", "needle"),
    [
        ("bf16-mixed", True, "bfloat16", None),
        ("fp16-mixed", True, "float16", None),
        ("fp32", False, "bfloat16", None),  # autocast's dtype setting means nothing while it is off
        ("bf16-mixed", False, "bfloat16", "ran without autocast"),
        ("fp16-mixed", True, "bfloat16", "to bfloat16, not float16"),
        ("fp32", True, "bfloat16", "autocasts by itself"),
    ],
)
def test_the_first_forward_must_run_in_the_modes_autocast(mode, enabled, dtype, needle):
    reason = autocast_mismatch(mode, enabled=enabled, dtype=dtype, device_type="cpu")
    assert (reason is None) if needle is None else (needle in reason)


def test_the_accelerator_must_run_the_mode():
    assert accelerator_mismatch("bf16-mixed", mixed_precision="bf16", native_amp=True, has_scaler=False,
                                device_type="cpu") is None
    assert accelerator_mismatch("fp16-mixed", mixed_precision="fp16", native_amp=True, has_scaler=True,
                                device_type="cuda") is None
    # Accelerate leaves fp16 off on a CPU: the run would be fp32 under fp16's name.
    cpu = accelerator_mismatch("fp16-mixed", mixed_precision="fp16", native_amp=False, has_scaler=False,
                               device_type="cpu")
    assert "cannot run fp16-mixed on cpu" in cpu and "trains in fp32" in cpu
    other = accelerator_mismatch("fp32", mixed_precision="bf16", native_amp=True, has_scaler=False, device_type="cpu")
    assert "mixed_precision='bf16', not 'no'" in other


def test_a_backed_off_scale_is_a_skipped_step():
    assert scaler_skipped(65536.0, 32768.0)
    assert not scaler_skipped(65536.0, 65536.0)
    assert not scaler_skipped(65536.0, 131072.0)  # grown after a clean interval
    assert not scaler_skipped(None, None) and not scaler_skipped(65536.0, None)
