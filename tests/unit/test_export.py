"""mpadvise export: every target by every mode and loss-scale kind, faithful or refused with the
reason; the named warnings; ``--json``; bad input through the CLI (typer's runner)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli._app import app
from advisor.frameworks import EXPORT_TARGETS, Export, export_policy
from advisor.frameworks._export import ExportRefused
from policies import Fp8Options, LossScale, Policy, TunedOn

runner = CliRunner()

# One policy per mode and per loss-scale kind or FP8 recipe: the matrix every target is judged on.
POLICIES: dict[str, Policy] = {
    "fp32": Policy(mode="fp32"),
    "tf32": Policy(mode="tf32"),
    "fp16-dynamic": Policy(mode="fp16-mixed"),
    "fp16-dynamic-tuned": Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=1024.0, growth_interval=500)),
    "fp16-static": Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=4096.0)),
    "fp16-none": Policy(mode="fp16-mixed", loss_scale=LossScale(kind="none")),
    "bf16-mixed": Policy(mode="bf16-mixed"),
    "fp16-true": Policy(mode="fp16-true"),
    "bf16-true": Policy(mode="bf16-true"),
    "te-delayed": Policy(mode="fp8-te"),
    "te-current": Policy(mode="fp8-te", fp8=Fp8Options(recipe="current")),
    "te-mxfp8": Policy(mode="fp8-te", fp8=Fp8Options(recipe="mxfp8")),
    "te-block": Policy(mode="fp8-te", fp8=Fp8Options(recipe="block")),
    "ao-tensorwise": Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="tensorwise")),
    "ao-rowwise": Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="rowwise")),
    "ao-rowwise-gw-hp": Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="rowwise_with_gw_hp")),
}

OK = "ok"
# What each target makes of each policy on CUDA: OK, or words of the refusal's reason.
EXPECTED: dict[str, dict[str, str]] = {
    "lightning": {
        "fp32": OK, "tf32": OK, "fp16-dynamic": OK, "fp16-dynamic-tuned": OK, "fp16-static": OK,
        "fp16-none": OK, "bf16-mixed": OK, "fp16-true": OK, "bf16-true": OK, "te-delayed": OK,
        "te-current": "only delayed", "te-mxfp8": "only delayed", "te-block": "only delayed",
        "ao-tensorwise": "cannot apply mode fp8-torchao", "ao-rowwise": "cannot apply mode fp8-torchao",
        "ao-rowwise-gw-hp": "cannot apply mode fp8-torchao",
    },
    "transformers": {
        "fp32": OK, "tf32": OK, "fp16-dynamic": OK, "fp16-dynamic-tuned": "cannot set GradScaler's init_scale, growth_interval",
        "fp16-static": "cannot apply a static loss scale", "fp16-none": "the policy has no loss scaling",
        "bf16-mixed": OK, "fp16-true": "cannot apply mode fp16-true", "bf16-true": "cannot apply mode bf16-true",
        "te-delayed": "cannot apply mode fp8-te", "te-current": "cannot apply mode fp8-te",
        "te-mxfp8": "cannot apply mode fp8-te", "te-block": "cannot apply mode fp8-te",
        "ao-tensorwise": "cannot apply mode fp8-torchao", "ao-rowwise": "cannot apply mode fp8-torchao",
        "ao-rowwise-gw-hp": "cannot apply mode fp8-torchao",
    },
    "accelerate": {
        "fp32": OK, "tf32": OK, "fp16-dynamic": OK, "fp16-dynamic-tuned": OK,
        "fp16-static": "cannot apply a static loss scale", "fp16-none": OK, "bf16-mixed": OK,
        "fp16-true": "cannot apply mode fp16-true", "bf16-true": "cannot apply mode bf16-true",
        "te-delayed": OK, "te-current": "cannot build the fp8-te recipe 'current'", "te-mxfp8": OK,
        "te-block": "cannot build the fp8-te recipe 'block'", "ao-tensorwise": OK, "ao-rowwise": OK,
        "ao-rowwise-gw-hp": OK,
    },
    "deepspeed": {
        "fp32": OK, "tf32": OK, "fp16-dynamic": OK, "fp16-dynamic-tuned": "cannot apply GradScaler's init_scale, growth_interval",
        "fp16-static": "cannot apply a static loss scale", "fp16-none": "the policy has no loss scaling", "bf16-mixed": OK,
        "fp16-true": "not pure 16-bit training", "bf16-true": "not pure 16-bit training",
        "te-delayed": "no fp8-te training", "te-current": "no fp8-te training", "te-mxfp8": "no fp8-te training",
        "te-block": "no fp8-te training", "ao-tensorwise": "no fp8-torchao training",
        "ao-rowwise": "no fp8-torchao training", "ao-rowwise-gw-hp": "no fp8-torchao training",
    },
    "torchtitan": {
        "fp32": OK, "tf32": OK, "fp16-dynamic": "no fp16 training", "fp16-dynamic-tuned": "no fp16 training",
        "fp16-static": "no fp16 training", "fp16-none": "no fp16 training", "bf16-mixed": OK,
        "fp16-true": "no fp16 training", "bf16-true": OK, "te-delayed": "no Transformer Engine path",
        "te-current": "no Transformer Engine path", "te-mxfp8": "no Transformer Engine path",
        "te-block": "no Transformer Engine path", "ao-tensorwise": "not tensorwise", "ao-rowwise": OK,
        "ao-rowwise-gw-hp": OK,
    },
}
EXPECTED["fabric"] = EXPECTED["lightning"]
# The plain torch loop: every mode but Transformer Engine's FP8 (its layers have parameters of their own,
# which the script's optimizer would not hold; torchao's Float8Linear keeps the Linear's).
EXPECTED["torch"] = {name: "cannot apply mode " + POLICIES[name].mode if name.startswith("te-") else OK
                     for name in POLICIES}

# The named warnings each export carries on CUDA (the rest carry none).
EXPECTED_WARNINGS: dict[tuple[str, str], list[str]] = {
    ("lightning", "te-delayed"): ["lightning-te-layer-swap"],
    ("fabric", "te-delayed"): ["lightning-te-layer-swap"],
    ("accelerate", "te-delayed"): ["accelerate-te-layer-swap"],
    ("accelerate", "te-mxfp8"): ["accelerate-te-layer-swap"],
    ("deepspeed", "fp32"): ["deepspeed-tf32"],
    ("deepspeed", "tf32"): ["deepspeed-tf32"],
    ("torchtitan", "bf16-true"): ["torchtitan-bf16-fp32-logits", "torchtitan-reduce-fp32"],
}

MATRIX = [(target, name) for target in EXPORT_TARGETS for name in POLICIES]


def test_the_matrix_covers_every_target_and_policy() -> None:
    assert set(EXPECTED) == set(EXPORT_TARGETS)
    for target in EXPORT_TARGETS:
        assert set(EXPECTED[target]) == set(POLICIES), target


@pytest.mark.parametrize(("target", "name"), MATRIX)
def test_every_target_every_mode_is_faithful_or_refused(target: str, name: str) -> None:
    policy = POLICIES[name]
    expected = EXPECTED[target][name]
    if expected != OK:
        with pytest.raises(ExportRefused) as refused:
            export_policy(policy, target)
        message = str(refused.value)
        assert message.startswith(f"cannot export {policy.describe()} to {target}: "), message
        assert expected in message
        assert "\n" not in message and refused.value.exit_code == 1
        return
    export = export_policy(policy, target)
    assert isinstance(export, Export) and export.target == target
    if export.format == "json":
        assert json.loads(export.text) == export.data["config"]
    else:
        # Python that parses, whose first statement, a string, names the policy
        docstring = ast.get_docstring(ast.parse(export.text))
        assert docstring is not None and docstring.startswith(f"mpadvise policy {policy.describe()}")
    assert [w.id for w in export.warnings] == EXPECTED_WARNINGS.get((target, name), [])
    for warning in export.warnings:
        assert warning.message and "\n" not in warning.message


# ---- Lightning and Fabric ---------------------------------------------------------------------


@pytest.mark.parametrize("target", ["lightning", "fabric"])
def test_lightning_precision_strings_come_from_the_traits(target: str) -> None:
    cls = "Trainer" if target == "lightning" else "Fabric"
    for name, precision in [("bf16-mixed", "bf16-mixed"), ("fp16-true", "16-true"), ("bf16-true", "bf16-true"),
                            ("fp32", "32-true"), ("tf32", "32-true")]:
        export = export_policy(POLICIES[name], target)
        assert export.data["precision"] == precision and export.data["plugin"] is None
        assert f"{cls.lower()} = {cls}(\n    precision='{precision}'," in export.text


def test_lightning_static_scale_is_a_gradscaler_whose_update_keeps_it() -> None:
    export = export_policy(POLICIES["fp16-static"], "lightning")
    assert "class StaticGradScaler(torch.amp.GradScaler):" in export.text
    assert "scaler = StaticGradScaler('cuda', 4096.0)" in export.text
    assert "plugins=[MixedPrecision('16-mixed', 'cuda', scaler=scaler)]" in export.text
    assert export.data["plugin"]["scaler"]["kind"] == "static"
    assert export.data["plugin"]["scaler"]["init_scale"] == 4096.0


def test_lightning_dynamic_scale_carries_every_gradscaler_setting() -> None:
    export = export_policy(POLICIES["fp16-dynamic-tuned"], "lightning", device="cpu")
    for line in ["'cpu',", "init_scale=1024.0,", "growth_factor=2.0,", "backoff_factor=0.5,", "growth_interval=500,"]:
        assert f"    {line}" in export.text
    assert "MixedPrecision('16-mixed', 'cpu', scaler=scaler)" in export.text
    assert "StaticGradScaler" not in export.text


def test_lightning_without_loss_scaling_disables_the_scaler() -> None:
    export = export_policy(POLICIES["fp16-none"], "fabric")
    assert "scaler = torch.amp.GradScaler('cuda', enabled=False)" in export.text
    assert export.data["plugin"]["scaler"]["kind"] == "none"


@pytest.mark.parametrize(("name", "legacy", "new", "allow"), [("fp32", "highest", "ieee", False), ("tf32", "high", "tf32", True)])
def test_lightning_sets_both_tf32_apis(name: str, legacy: str, new: str, allow: bool) -> None:
    text = export_policy(POLICIES[name], "lightning").text
    assert f"torch.set_float32_matmul_precision('{legacy}')" in text
    assert f"torch.backends.cudnn.allow_tf32 = {allow}" in text  # Lightning leaves cuDNN's TF32 on
    for switch in ("cuda.matmul", "mkldnn.matmul", "cudnn.conv", "cudnn.rnn"):
        assert f"torch.backends.{switch}.fp32_precision = '{new}'" in text
    assert text.index("set_float32_matmul_precision") < text.index("cuda.matmul.fp32_precision")
    cpu = export_policy(POLICIES[name], "lightning", device="cpu").text
    assert "cudnn" not in cpu and f"torch.backends.mkldnn.matmul.fp32_precision = '{new}'" in cpu


def test_lightning_fp8_te_plugin_keeps_fp32_weights_and_the_delayed_recipe() -> None:
    policy = Policy(mode="fp8-te", fp8=Fp8Options(fp8_format="e4m3", amax_history_len=16, margin=1))
    export = export_policy(policy, "lightning")
    assert "weights_dtype=torch.float32," in export.text
    assert "fallback_compute_dtype=torch.bfloat16," in export.text
    assert "recipe={'fp8_format': 'E4M3', 'amax_history_len': 16, 'margin': 1}," in export.text
    with pytest.raises(ExportRefused, match="Transformer Engine runs on CUDA only"):
        export_policy(policy, "lightning", device="cpu")


def test_lightning_trainer_accumulates_and_clips_fabric_says_how() -> None:
    policy = Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4, grad_clip_norm=0.5)
    trainer = export_policy(policy, "lightning")
    assert "    accumulate_grad_batches=4," in trainer.text
    assert "    gradient_clip_val=0.5," in trainer.text and "    gradient_clip_algorithm='norm'," in trainer.text
    assert "The DataLoader's batch_size must be 16" in trainer.text
    assert trainer.data["dataloader_batch_size"] == 16
    assert trainer.data["trainer"] == {"accumulate_grad_batches": 4, "gradient_clip_val": 0.5,
                                       "gradient_clip_algorithm": "norm"}
    fabric = export_policy(policy, "fabric")
    assert "accumulate_grad_batches" not in fabric.text
    assert "fabric.backward(loss / 4)" in fabric.text and "max_norm=0.5" in fabric.text
    assert fabric.data["accumulate"] == 4


# ---- the HF Trainer ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "tf32", "fp16-dynamic", "bf16-mixed"])
def test_transformers_fields_are_the_traits_and_the_batch(name: str) -> None:
    policy = POLICIES[name].with_(micro_batch_size=8, grad_accum_steps=3)
    fields = export_policy(policy, "transformers").data["training_arguments"]
    precision = {"fp32": {"fp16": False, "bf16": False, "tf32": False},
                 "tf32": {"fp16": False, "bf16": False, "tf32": True},
                 "fp16-mixed": {"fp16": True, "bf16": False, "tf32": False},
                 "bf16-mixed": {"fp16": False, "bf16": True, "tf32": False}}[policy.mode]
    assert fields == {**precision, "per_device_train_batch_size": 8,
                      "gradient_accumulation_steps": 3}


def test_transformers_clipping_is_set_only_by_a_policy_that_clips() -> None:
    assert export_policy(Policy(mode="bf16-mixed", grad_clip_norm=2.0), "transformers").data[
        "training_arguments"]["max_grad_norm"] == 2.0
    # Without clipping in the policy the trials kept the script's max_grad_norm: so does the export.
    fields = export_policy(Policy(mode="bf16-mixed"), "transformers").data["training_arguments"]
    assert "max_grad_norm" not in fields and "per_device_train_batch_size" not in fields


def test_transformers_keeps_the_scripts_batch_and_names_the_device() -> None:
    """Kept accumulation is left out (merged with the script's own it was a duplicate keyword,
    and 1 halved an 8 x 2 global batch); a CPU export says use_cpu, as TrainingArguments needs."""
    kept = export_policy(Policy(mode="bf16-mixed"), "transformers", device="cpu")
    fields = kept.data["training_arguments"]
    assert "gradient_accumulation_steps" not in fields and "per_device_train_batch_size" not in fields
    assert fields["use_cpu"] is True
    assert any("gradient_accumulation_steps stay as the script sets them" in note for note in kept.notes)
    assert "use_cpu" not in export_policy(Policy(mode="bf16-mixed"), "transformers", device="cuda").data[
        "training_arguments"]


def test_transformers_refuses_tf32_on_a_cpu() -> None:
    with pytest.raises(ExportRefused, match=r"TrainingArguments\(tf32=True\) needs an Ampere or newer GPU"):
        export_policy(POLICIES["tf32"], "transformers", device="cpu")


def test_lightning_writes_no_accumulation_for_a_kept_batch() -> None:
    export = export_policy(Policy(mode="bf16-mixed"), "lightning")
    assert export.data["trainer"] == {} and "accumulate_grad_batches" not in export.text
    split = export_policy(Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=1), "lightning")
    assert split.data["trainer"] == {"accumulate_grad_batches": 1}


def test_transformers_refuses_fp16_on_a_cpu() -> None:
    with pytest.raises(ExportRefused, match="on cpu it would silently train in fp32"):
        export_policy(POLICIES["fp16-dynamic"], "transformers", device="cpu")
    assert export_policy(POLICIES["bf16-mixed"], "transformers", device="cpu").data["training_arguments"]["bf16"]


# ---- Accelerate -------------------------------------------------------------------------------


def test_accelerate_grad_scaler_kwargs_carry_the_loss_scale() -> None:
    export = export_policy(POLICIES["fp16-dynamic-tuned"], "accelerate")
    assert export.data["accelerator"] == {"mixed_precision": "fp16"}
    assert export.data["kwargs_handlers"] == [{"class": "GradScalerKwargs", "kwargs": {
        "init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 500}}]
    assert "accelerator.native_amp" not in export.text
    none = export_policy(POLICIES["fp16-none"], "accelerate")
    assert none.data["kwargs_handlers"][0]["kwargs"] == {"enabled": False}


def test_accelerate_on_a_cpu_turns_fp16_autocast_on_itself() -> None:
    export = export_policy(POLICIES["fp16-dynamic"], "accelerate", device="cpu")
    assert "accelerator.native_amp = True" in export.text
    assert "accelerator.scaler = torch.amp.GradScaler(" in export.text
    assert export.data["config_file"]["use_cpu"] is True


@pytest.mark.parametrize(("name", "pad"), [("ao-tensorwise", True), ("ao-rowwise", True), ("ao-rowwise-gw-hp", False)])
def test_accelerate_torchao_handler_matches_mpadvise_filter_and_config(name: str, pad: bool) -> None:
    export = export_policy(POLICIES[name], "accelerate")
    recipe = POLICIES[name].fp8.recipe
    assert export.data["accelerator"]["mixed_precision"] == "fp8"
    assert export.data["config_file"]["fp8_config"] == {"backend": "AO"}
    assert export.data["kwargs_handlers"] == [{
        "class": "AORecipeKwargs", "recipe": recipe, "pad_inner_dim": pad,
        "module_filter": "torch.nn.Linear with in and out features multiples of 16"}]
    assert f"Float8LinearConfig.from_recipe_name('{recipe}')" in export.text
    assert ("pad_inner_dim=True" in export.text) == pad
    with pytest.raises(ExportRefused, match="bf16 autocast"):
        export_policy(POLICIES[name], "accelerate", device="cpu")


def test_accelerate_te_recipe_is_the_loop_apis() -> None:
    delayed = export_policy(POLICIES["te-delayed"], "accelerate").data["kwargs_handlers"]
    assert delayed == [{"class": "TERecipeKwargs", "kwargs": {
        "fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "max", "margin": 0}}]
    mxfp8 = export_policy(POLICIES["te-mxfp8"], "accelerate")
    assert mxfp8.data["kwargs_handlers"][0]["kwargs"] == {"use_mxfp8_block_scaling": True}
    assert "multiple of 32" in mxfp8.warnings[0].message


def test_accelerate_batch_clip_and_config_file() -> None:
    policy = Policy(mode="bf16-mixed", micro_batch_size=32, grad_accum_steps=2, grad_clip_norm=1.0)
    export = export_policy(policy, "accelerate")
    assert export.data["accelerator"] == {"mixed_precision": "bf16", "gradient_accumulation_steps": 2}
    assert "The DataLoader's batch_size must be 32" in export.text and "accelerator.accumulate(model)" in export.text
    assert "accelerator.clip_grad_norm_(model.parameters(), 1.0)" in export.text
    yaml_text = export.data["config_file_yaml"]
    assert yaml.safe_load(yaml_text) == export.data["config_file"]
    assert "mixed_precision: bf16" in yaml_text and "distributed_type: 'NO'" in yaml_text
    for line in yaml_text.splitlines():
        assert f"#   {line}" in export.text  # the file, shown in the code as a comment


# ---- DeepSpeed --------------------------------------------------------------------------------


def test_deepspeed_mixed_modes_are_autocast_over_fp32_weights() -> None:
    fp16 = export_policy(Policy(mode="fp16-mixed", micro_batch_size=8, grad_accum_steps=4), "deepspeed")
    config = fp16.data["config"]
    assert config == {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "torch_autocast": {"enabled": True, "dtype": "float16", "lower_precision_safe_modules": []},
    }
    assert any("0.18.0" in note for note in fp16.notes)
    bf16 = export_policy(Policy(mode="bf16-mixed", grad_clip_norm=1.5), "deepspeed")
    assert bf16.data["config"]["torch_autocast"]["dtype"] == "bfloat16"
    assert bf16.data["config"]["gradient_clipping"] == 1.5
    assert any("train_micro_batch_size_per_gpu" in note for note in bf16.notes)
    assert any("0.17.2" in note for note in bf16.notes)


def test_deepspeed_keeps_the_scripts_batch_and_clipping() -> None:
    """A policy that keeps the script's 8 x 2 writes no accumulation (DeepSpeed would take 1), and
    one that does not clip never turns clipping off: the notes say what to add."""
    export = export_policy(Policy(mode="bf16-mixed"), "deepspeed")
    config = export.data["config"]
    assert "gradient_accumulation_steps" not in config and "train_micro_batch_size_per_gpu" not in config
    assert "gradient_clipping" not in config
    notes = " ".join(export.notes)
    for field in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert f"add {field}" in notes


def test_deepspeed_fp32_has_no_precision_section_and_names_the_tf32_gap() -> None:
    export = export_policy(Policy(mode="fp32", micro_batch_size=4, grad_accum_steps=1), "deepspeed")
    assert "torch_autocast" not in export.data["config"] and export.data["config"]["fp16"] == {"enabled": False}
    assert "cudnn.allow_tf32 = False" in export.warnings[0].message
    assert "set_float32_matmul_precision" in export_policy(POLICIES["tf32"], "deepspeed").warnings[0].message


def test_deepspeed_refuses_fp16_on_a_cpu() -> None:
    with pytest.raises(ExportRefused, match="not a CPU"):
        export_policy(POLICIES["fp16-dynamic"], "deepspeed", device="cpu")


# ---- torchtitan -------------------------------------------------------------------------------


def test_torchtitan_config_fields() -> None:
    mixed = export_policy(Policy(mode="bf16-mixed", micro_batch_size=2, grad_accum_steps=8), "torchtitan")
    assert mixed.data["training"] == {"dtype": "float32", "mixed_precision_param": "bfloat16",
                                      "mixed_precision_reduce": "float32"}
    assert "def apply_mpadvise_policy(config, data_parallel_degree=1):" in mixed.text
    assert "    config.training.local_batch_size = 2" in mixed.text
    assert "config.training.local_batch_size * 8 * data_parallel_degree" in mixed.text
    assert any("max_norm stays" in note for note in mixed.notes)
    true = export_policy(Policy(mode="bf16-true", grad_clip_norm=1.0), "torchtitan")
    assert true.data["training"]["dtype"] == "bfloat16" and true.data["training"]["max_norm"] == 1.0
    assert "def apply_mpadvise_policy(config):" in true.text and "batch_size" not in true.text
    assert any("local_batch_size and global_batch_size stay" in note for note in true.notes)
    fp32 = export_policy(POLICIES["fp32"], "torchtitan")
    assert fp32.data["training"]["mixed_precision_param"] == "float32"
    assert "torch.set_float32_matmul_precision('highest')" in fp32.text
    assert "inf" not in fp32.text  # clipping is never turned off


def test_torchtitan_float8_converter_takes_every_eligible_linear() -> None:
    export = export_policy(POLICIES["ao-rowwise-gw-hp"], "torchtitan")
    assert export.data["float8"] == {"recipe_name": "rowwise_with_gw_hp", "filter_fqns": []}
    assert "    recipe_name='rowwise_with_gw_hp',\n    filter_fqns=[],\n)" in export.text


# ---- the batch split and the reduce dtype ---------------------------------------------------


def test_a_micro_batch_without_accumulation_needs_the_tuned_global_batch() -> None:
    hand_written = Policy(mode="bf16-mixed", micro_batch_size=16)
    for target in ("lightning", "transformers", "deepspeed"):
        with pytest.raises(ExportRefused, match="add grad_accum_steps to the config"):
            export_policy(hand_written, target)
    tuned = hand_written.with_(tuned_on=TunedOn(hardware_fingerprint="abc", cuda="12.8", global_batch=64))
    assert export_policy(tuned, "deepspeed").data["config"]["gradient_accumulation_steps"] == 4
    assert export_policy(tuned, "transformers").data["training_arguments"]["gradient_accumulation_steps"] == 4


def test_a_non_default_reduce_dtype_is_named() -> None:
    policy = Policy(mode="bf16-mixed", reduce_dtype="bf16")
    for target in ("lightning", "transformers", "accelerate", "deepspeed"):
        assert "reduce-dtype-not-exported" in [w.id for w in export_policy(policy, target).warnings]
    assert [w.id for w in export_policy(policy, "torchtitan").warnings] == ["torchtitan-reduce-fp32"]
    assert export_policy(Policy(mode="bf16-mixed", reduce_dtype="fp32"), "lightning").warnings == ()


def test_an_unknown_target_or_device_is_a_usage_error() -> None:
    from probes import UsageError

    with pytest.raises(UsageError, match="unknown export target 'keras'"):
        export_policy(POLICIES["fp32"], "keras")
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        export_policy(POLICIES["fp32"], "lightning", device="tpu")


# ---- the CLI ----------------------------------------------------------------------------------


def _config(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


TUNED_FP16 = """
schema = 1
mode = "fp16-mixed"
micro_batch_size = 16
grad_accum_steps = 4

[loss_scale]
kind = "static"
init_scale = 2048.0
"""


def test_cli_prints_the_export_and_warnings_go_to_stderr(tmp_path: Path) -> None:
    config = _config(tmp_path, 'schema = 1\nmode = "fp32"\n')
    result = runner.invoke(app, ["export", str(config), "--to", "deepspeed"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fp16"] == {"enabled": False}
    assert "warning deepspeed-tf32:" in result.stderr
    assert "note: add train_micro_batch_size_per_gpu" in result.stderr


def test_cli_json_shape(tmp_path: Path) -> None:
    config = _config(tmp_path, TUNED_FP16)
    result = runner.invoke(app, ["export", str(config), "--to", "lightning", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert set(document) == {"policy", "source", "device", "target", "format", "text", "settings", "warnings", "notes"}
    assert document["policy"]["mode"] == "fp16-mixed" and document["source"] == f"config file {config}"
    assert document["target"] == "lightning" and document["format"] == "python" and document["device"] == "cuda"
    assert document["settings"]["plugin"]["scaler"] == {"kind": "static", "init_scale": 2048.0, "growth_factor": 2.0,
                                                         "backoff_factor": 0.5, "growth_interval": 2000}
    assert document["settings"]["dataloader_batch_size"] == 16
    assert "StaticGradScaler" in document["text"]
    assert document["warnings"] == [] and document["notes"] == []
    warned = runner.invoke(app, ["export", str(_config(tmp_path, 'mode = "tf32"\n', "t.toml")), "--to", "deepspeed", "--json"])
    assert json.loads(warned.stdout)["warnings"][0]["id"] == "deepspeed-tf32"


def test_cli_out_writes_the_file(tmp_path: Path) -> None:
    config = _config(tmp_path, TUNED_FP16.replace('kind = "static"', 'kind = "dynamic"'))
    out = tmp_path / "accelerate_setup.py"
    result = runner.invoke(app, ["export", str(config), "--to", "accelerate", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and f"wrote {out}" in result.stderr
    assert "GradScalerKwargs(" in out.read_text()
    as_json = tmp_path / "export.json"
    result = runner.invoke(app, ["export", str(config), "--to", "transformers", "--json", "--out", str(as_json)])
    assert result.exit_code == 1  # transformers cannot set the initial scale
    assert not as_json.exists()


def test_cli_out_writes_the_format_its_extension_names(tmp_path: Path) -> None:
    """``--out x.yaml`` writes accelerate's config file, which its own loader reads."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = _config(tmp_path, 'mode = "bf16-mixed"\nmicro_batch_size = 16\ngrad_accum_steps = 4\n')
    out = tmp_path / "accelerate.yaml"
    result = runner.invoke(app, ["export", str(config), "--to", "accelerate", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_config_from_file(str(out)).mixed_precision == "bf16"
    assert "note: set the DataLoader's batch_size to 16" in result.stderr
    assert "gradient_accumulation_steps=4" in result.stderr
    # A format the target does not write, and a config file that cannot carry the policy: one line each.
    for argv, code, needle in [
        (["--to", "accelerate", "--out", str(tmp_path / "a.txt")], 2, "written as python (.py); yaml (.yaml, .yml)"),
        (["--to", "deepspeed", "--out", str(tmp_path / "ds.py")], 2, "written as json (.json)"),
    ]:
        result = runner.invoke(app, ["export", str(config), *argv])
        assert result.exit_code == code, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr, result.stderr
    tuned = _config(tmp_path, 'mode = "fp16-mixed"\n[loss_scale]\ninit_scale = 1024.0\n', "fp16.toml")
    result = runner.invoke(app, ["export", str(tuned), "--to", "accelerate", "--out", str(tmp_path / "f.yml")])
    assert result.exit_code == 1 and "cannot carry the GradScaler's settings" in result.stderr
    assert "--out FILE.py" in result.stderr and not (tmp_path / "f.yml").exists()


def test_cli_device_follows_where_the_policy_was_tuned(tmp_path: Path) -> None:
    cpu = _config(tmp_path, 'mode = "fp16-mixed"\n\n[tuned_on]\nhardware_fingerprint = "cpu-abc"\ncuda = ""\n')
    result = runner.invoke(app, ["export", str(cpu), "--to", "lightning", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device"] == "cpu"
    assert "MixedPrecision('16-mixed', 'cpu'" in json.loads(result.stdout)["text"]


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["export", "{config}", "--to", "keras"], 2, "unknown export target 'keras'; expected one of lightning, fabric"),
    (["export", "{config}"], 2, "missing --to TARGET"),
    (["export", "--to", "lightning"], 2, "needs a config file (.toml) or a training script (.py)"),
    (["export", "{tmp}/missing.toml", "--to", "lightning"], 2, "missing.toml does not exist"),
    (["export", "{tmp}/settings.yaml", "--to", "lightning"], 2, "expected a config file (.toml"),
    (["export", "{bad}", "--to", "lightning"], 2, "invalid TOML"),
    (["export", "{config}", "--to", "lightning", "--out", "{tmp}/nodir/x.py"], 2, "nodir does not exist"),
    (["export", "{config}", "--to", "torchtitan"], 1, "torchtitan has no fp16 training"),
])
def test_cli_bad_input_is_one_line(tmp_path: Path, args: list[str], code: int, needle: str) -> None:
    config = _config(tmp_path, TUNED_FP16)
    bad = _config(tmp_path, "mode = [unclosed", "bad.toml")
    _config(tmp_path, "mode: fp32\n", "settings.yaml")
    argv = [a.format(config=config, bad=bad, tmp=tmp_path) for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert result.stdout == "" and "Traceback" not in result.output


def test_cli_exports_a_scripts_policy_as_mpadvise_policy_resolves_it(tmp_path: Path, cache_home: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import advisor\nmp = advisor.load_policy()\n", encoding="utf-8")
    (tmp_path / "train.mpadvise.toml").write_text('mode = "bf16-mixed"\ngrad_clip_norm = 1.0\n', encoding="utf-8")
    result = runner.invoke(app, ["export", str(script), "--to", "transformers", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["source"].startswith("config file") and document["source"].endswith("train.mpadvise.toml")
    assert document["settings"]["training_arguments"]["bf16"] is True
    assert document["settings"]["training_arguments"]["max_grad_norm"] == 1.0
    (tmp_path / "train.mpadvise.toml").unlink()
    # Nothing tuned: this machine's safe default (never a -true mode, so DeepSpeed takes it), for
    # this machine's device.
    import torch

    result = runner.invoke(app, ["export", str(script), "--to", "deepspeed", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["source"].startswith("safe default")
    assert document["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


# ---- generated files are data: a config path cannot inject code --------------------------------

INJECTED = "x\nimport os; os.system('echo pwned') # \"'\"\"\" ]} \r\n"


def _python_strings_only(text: str, payload: str) -> None:
    """``text`` parses, and ``payload`` appears in it only inside string literals."""
    import io
    import tokenize

    tree = ast.parse(text)
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import) and any(a.name == "os" for a in n.names)]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.STRING:
            assert "pwned" not in token.string and "os.system" not in token.string, token


@pytest.mark.parametrize(("target", "name"), [(t, n) for t, n in MATRIX if EXPECTED[t][n] == OK])
def test_a_source_with_quotes_and_newlines_stays_inside_a_string(target: str, name: str) -> None:
    export = export_policy(POLICIES[name], target, source=f"config file {INJECTED}.toml")
    if export.format == "json":
        assert json.loads(export.text) == export.data["config"]
    else:
        _python_strings_only(export.text, INJECTED)
