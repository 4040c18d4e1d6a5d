"""Every export loads back into its own framework: the Lightning Trainer and Fabric run the
emitted code, TrainingArguments takes the fields, Accelerate builds the Accelerator from the
emitted kwargs handlers and reads the config file with its own loader, DeepSpeed parses the
JSON with its own ``DeepSpeedConfig``. torchtitan is not installable here, so its snippet is
checked against the fields of its config dataclasses."""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import pytest
import torch

from advisor.frameworks import export_policy
from advisor.frameworks._export import Export
from policies import Fp8Options, LossScale, Policy, create_mode
from policies._switches import matmul_switches

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def run_export(export: Export, **names: Any) -> dict[str, Any]:
    """Execute an export's Python text as a user would paste it; its names come back."""
    namespace: dict[str, Any] = dict(names)
    exec(compile(export.text, f"<{export.target} export>", "exec"), namespace)
    return namespace


@contextlib.contextmanager
def tf32_restored(tf32: bool | None) -> Iterator[None]:
    """Run an fp32/tf32 export between switches set the other way, restored exactly after."""
    if tf32 is None:
        yield
        return
    with matmul_switches(tf32=not tf32, cuda=True):
        yield


def fp32_switches() -> dict[str, Any]:
    """Both of torch's TF32 APIs, as code reading them sees them."""
    get = torch._C._get_fp32_precision_getter
    return {
        "legacy_matmul": torch.get_float32_matmul_precision(),  # what Lightning reads
        **{f"{backend}.{op}": get(backend, op) for backend, op in
           (("cuda", "matmul"), ("mkldnn", "matmul"), ("cuda", "conv"), ("cuda", "rnn"))},
    }


# ---- Lightning: the Trainer and Fabric --------------------------------------------------------

LIGHTNING_POLICIES = {
    "fp32": Policy(mode="fp32"),
    "tf32": Policy(mode="tf32"),
    "bf16-mixed": Policy(mode="bf16-mixed", micro_batch_size=8, grad_accum_steps=2, grad_clip_norm=0.5),
    "bf16-true": Policy(mode="bf16-true"),
    "fp16-true": Policy(mode="fp16-true"),
    "fp16-dynamic": Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=1024.0, growth_interval=50)),
    "fp16-static": Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=4096.0)),
    "fp16-none": Policy(mode="fp16-mixed", loss_scale=LossScale(kind="none")),
}


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # a Trainer may create lightning_logs/ in the working directory
    return tmp_path


@pytest.mark.parametrize("name", list(LIGHTNING_POLICIES))
def test_lightning_trainer_takes_the_export(name: str, in_tmp: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    policy = LIGHTNING_POLICIES[name]
    export = export_policy(policy, "lightning", device=DEVICE)
    with tf32_restored(export.data["tf32"]):
        namespace = run_export(export)
        switches = fp32_switches()
    trainer = namespace["trainer"]
    if export.data["precision"] is not None:
        assert trainer.precision == export.data["precision"]
    else:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"
        assert plugin.scaler is namespace["scaler"]
    if export.data["tf32"] is not None:
        new = "tf32" if export.data["tf32"] else "ieee"
        expected = {"legacy_matmul": "high" if export.data["tf32"] else "highest", "cuda.matmul": new, "mkldnn.matmul": new}
        if CUDA:  # the cuDNN switches are set for CUDA training only, as mpadvise's modes do
            expected.update({"cuda.conv": new, "cuda.rnn": new})
        assert {k: v for k, v in switches.items() if k in expected} == expected
    if name == "bf16-mixed":
        assert trainer.accumulate_grad_batches == 2
        assert trainer.gradient_clip_val == 0.5 and trainer.gradient_clip_algorithm == "norm"


@pytest.mark.parametrize("name", list(LIGHTNING_POLICIES))
def test_fabric_takes_the_export(name: str, in_tmp: Path) -> None:
    from lightning.fabric.plugins import MixedPrecision

    policy = LIGHTNING_POLICIES[name]
    export = export_policy(policy, "fabric", device=DEVICE)
    with tf32_restored(export.data["tf32"]):
        namespace = run_export(export)
    precision = namespace["fabric"].strategy.precision
    if export.data["precision"] is not None:
        assert precision.precision == export.data["precision"]
    else:
        assert isinstance(precision, MixedPrecision) and precision.scaler is namespace["scaler"]


def _scaled_step(scaler: Any, *, overflow: bool) -> tuple[bool, float]:
    """One real GradScaler step on a tiny model; whether the weights moved, and the scale after."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    loss = model(torch.ones(2, 4)).sum() * (float("inf") if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return not torch.equal(before, model.weight.detach()), float(scaler.get_scale())


def test_the_static_scaler_keeps_its_scale_and_still_skips(in_tmp: Path) -> None:
    export = export_policy(LIGHTNING_POLICIES["fp16-static"], "lightning", device=DEVICE)
    scaler = run_export(export)["scaler"]
    assert _scaled_step(scaler, overflow=True) == (False, 4096.0)  # skipped, scale kept (dynamic: 2048)
    assert _scaled_step(scaler, overflow=False) == (True, 4096.0)
    dynamic = run_export(export_policy(LIGHTNING_POLICIES["fp16-dynamic"], "lightning", device=DEVICE))["scaler"]
    assert _scaled_step(dynamic, overflow=True) == (False, 512.0)  # the policy's 1024, backed off by 0.5
    off = run_export(export_policy(LIGHTNING_POLICIES["fp16-none"], "lightning", device=DEVICE))["scaler"]
    assert not off.is_enabled()


def test_lightning_fp8_te_plugin_builds() -> None:
    pytest.importorskip("transformer_engine", reason="Transformer Engine needs CUDA; not installed here")
    from lightning.pytorch.plugins import TransformerEnginePrecision

    export = export_policy(Policy(mode="fp8-te"), "lightning")
    trainer = run_export(export)["trainer"]
    plugin = trainer.precision_plugin
    assert isinstance(plugin, TransformerEnginePrecision) and plugin.weights_dtype == torch.float32


# ---- the HF Trainer ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "tf32", "fp16-mixed", "bf16-mixed"])
def test_training_arguments_take_the_fields(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import TrainingArguments

    if name == "tf32" and not CUDA:
        pytest.skip("TrainingArguments(tf32=True) raises without an Ampere or newer GPU")
    policy = Policy(mode=name, micro_batch_size=4, grad_accum_steps=8)
    # For CUDA: on a CPU the export refuses fp16 (the HF Trainer would train in fp32 there),
    # but TrainingArguments itself takes the fields on any machine.
    export = export_policy(policy, "transformers", device="cuda")
    fields = run_export(export)["training_arguments"]
    assert fields == export.data["training_arguments"]
    # bf16 on a CPU needs use_cpu (TrainingArguments' own rule); the export is for the device it names.
    extra = {} if CUDA else {"use_cpu": True}
    args = TrainingArguments(**fields, output_dir=str(tmp_path), report_to="none", **extra)
    for key, value in fields.items():
        assert getattr(args, key) == value, key


# ---- Accelerate -------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state: each Accelerator here starts from none."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    reset()
    yield
    reset()


ACCELERATE_POLICIES = {
    "fp32": Policy(mode="fp32"),
    "tf32": Policy(mode="tf32"),
    "bf16-mixed": Policy(mode="bf16-mixed", micro_batch_size=8, grad_accum_steps=4),
    "fp16-dynamic": Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=1024.0, growth_interval=50)),
    "fp16-none": Policy(mode="fp16-mixed", loss_scale=LossScale(kind="none")),
}


@pytest.mark.parametrize("name", list(ACCELERATE_POLICIES))
def test_accelerator_takes_the_export(name: str, fresh_accelerate_state: None, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    export = export_policy(ACCELERATE_POLICIES[name], "accelerate", device=DEVICE)
    with tf32_restored(export.data["tf32"]):
        accelerator = run_export(export)["accelerator"]
    assert accelerator.mixed_precision == export.data["accelerator"]["mixed_precision"]
    assert accelerator.gradient_accumulation_steps == export.data["accelerator"].get("gradient_accumulation_steps", 1)
    # The config file, through accelerate's own loader (it refuses unknown keys).
    config_path = tmp_path / "accelerate.yaml"
    config_path.write_text(export.data["config_file_yaml"], encoding="utf-8")
    config = load_config_from_file(str(config_path))
    assert config.mixed_precision == export.data["config_file"]["mixed_precision"]
    assert config.use_cpu is (DEVICE == "cpu")
    if ACCELERATE_POLICIES[name].mode == "fp16-mixed":
        settings = export.data["kwargs_handlers"][0]["kwargs"]
        scaler = accelerator.scaler
        assert scaler is not None and accelerator.native_amp
        if settings.get("enabled") is False:
            assert not scaler.is_enabled()
        else:
            assert scaler.get_scale() == settings["init_scale"]
            assert scaler.get_growth_interval() == settings["growth_interval"]
        # The forward runs in fp16 autocast, on a CPU too (where the export turns it on);
        # Accelerate hands the model's output back in fp32, so an inner layer's output is looked at.
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        seen: list[torch.dtype] = []
        model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
        accelerator.prepare(model)(torch.ones(2, 4).to(accelerator.device))
        assert seen == [torch.float16]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_accelerate_torchao_handler_converts_the_layers_mpadvise_converts(recipe: str, fresh_accelerate_state: None) -> None:
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from accelerate.utils.ao import convert_model_to_fp8_ao

    policy = Policy(mode="fp8-torchao", fp8=Fp8Options(recipe=recipe))
    export = export_policy(policy, "accelerate", device="cuda")  # a CPU export is refused
    accelerator = run_export(export)["accelerator"]
    assert accelerator.mixed_precision == "fp8"
    handler = accelerator.ao_recipe_handler
    assert handler.config.pad_inner_dim == export.data["kwargs_handlers"][0]["pad_inner_dim"]

    def model() -> torch.nn.Module:
        # first and last Linear eligible (Accelerate's default filter would skip them), one
        # Linear too narrow for FP8
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 24),
                                   torch.nn.Linear(24, 48), torch.nn.Linear(48, 16))

    theirs = model()
    convert_model_to_fp8_ao(theirs, config=handler.config, module_filter_func=handler.module_filter_func)
    ours = create_mode(policy, torch.device("cpu")).convert_module(model())

    def fp8_layers(module: torch.nn.Module) -> list[str]:
        return [name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"]

    assert fp8_layers(theirs) == fp8_layers(ours) == ["0", "4"]
    assert dataclasses.asdict(copy.deepcopy(theirs[0].config)) == dataclasses.asdict(copy.deepcopy(ours[0].config))


def test_accelerate_te_handler_builds(fresh_accelerate_state: None) -> None:
    pytest.importorskip("transformer_engine", reason="Transformer Engine needs CUDA; not installed here")
    accelerator = run_export(export_policy(Policy(mode="fp8-te"), "accelerate"))["accelerator"]
    assert accelerator.mixed_precision == "fp8" and accelerator.te_recipe_handler.amax_compute_algo == "max"


# ---- DeepSpeed --------------------------------------------------------------------------------

DEEPSPEED_POLICIES = {
    "fp32": Policy(mode="fp32", micro_batch_size=8, grad_accum_steps=2),
    "tf32": Policy(mode="tf32", grad_clip_norm=1.0),
    "fp16-mixed": Policy(mode="fp16-mixed", micro_batch_size=4, grad_accum_steps=8),
    "bf16-mixed": Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=1, grad_clip_norm=0.25),
}

# DeepSpeed's documented config (deepspeed.ai/docs/config-json), for the keys an export writes:
# each key's type, and for the sections their fields' types.
DEEPSPEED_SCHEMA: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": int,
    "gradient_accumulation_steps": int,
    "gradient_clipping": float,
    "fp16": {"enabled": bool},
    "bf16": {"enabled": bool},
    "torch_autocast": {"enabled": bool, "dtype": str, "lower_precision_safe_modules": list},
}
# DeepSpeed's DtypeEnum names for torch_autocast.dtype.
DEEPSPEED_AUTOCAST_DTYPES = ("torch.float16", "fp16", "float16", "half", "torch.bfloat16", "bf16", "bfloat16")


@pytest.mark.parametrize("name", list(DEEPSPEED_POLICIES))
def test_deepspeed_config_matches_the_documented_schema(name: str) -> None:
    config = export_policy(DEEPSPEED_POLICIES[name], "deepspeed", device="cuda").data["config"]
    for key, value in config.items():
        assert key in DEEPSPEED_SCHEMA, key
        kind = DEEPSPEED_SCHEMA[key]
        if isinstance(kind, dict):
            assert set(value) <= set(kind), key
            for field_name, field_value in value.items():
                assert isinstance(field_value, kind[field_name]), (key, field_name)
        else:
            assert isinstance(value, kind) and not isinstance(value, bool), key
    autocast = config.get("torch_autocast")
    if autocast is not None:
        assert autocast["dtype"] in DEEPSPEED_AUTOCAST_DTYPES and autocast["lower_precision_safe_modules"] == []


@pytest.mark.parametrize("name", list(DEEPSPEED_POLICIES))
def test_deepspeed_parses_the_config(name: str) -> None:
    pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed (pip install deepspeed)")
    from deepspeed.runtime.config import DeepSpeedConfig

    policy = DEEPSPEED_POLICIES[name]
    export = export_policy(policy, "deepspeed", device="cuda")
    config = dict(export.data["config"])
    if "train_micro_batch_size_per_gpu" not in config:
        config["train_micro_batch_size_per_gpu"] = 32  # the note says to add the script's batch
        assert any("train_micro_batch_size_per_gpu" in note for note in export.notes)
    parsed = DeepSpeedConfig(config)
    assert parsed.train_micro_batch_size_per_gpu == config["train_micro_batch_size_per_gpu"]
    assert parsed.gradient_accumulation_steps == config["gradient_accumulation_steps"]
    assert parsed.gradient_clipping == (policy.grad_clip_norm or 0.0)
    assert not parsed.float16_config.enabled and not parsed.bfloat16_config.enabled
    expected_dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(policy.mode)
    assert parsed.torch_autocast_enabled is (expected_dtype is not None)
    if expected_dtype is not None:
        assert parsed.torch_autocast_dtype == expected_dtype
        assert parsed.torch_autocast_lower_precision_safe_modules == []


# ---- torchtitan -------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class TorchtitanTrainingConfig:
    """The fields of torchtitan's ``TrainingConfig`` that an export sets, with their types
    (torchtitan/config/configs.py on its main branch, 2026). ``slots``: setting any other
    field raises, as on the real one."""

    num_tokens_per_microbatch_per_dp_rank: int = 16384
    num_tokens_per_train_step: int = -1
    max_context_length: int = 2048
    max_norm: float | int = 1.0
    dtype: Literal["bfloat16", "float32"] = "float32"
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    mixed_precision_reduce: Literal["float32"] = "float32"


# torchtitan's Float8LinearConverter.Config fields and recipe names (components/quantization/float8.py).
TORCHTITAN_FLOAT8_FIELDS = {"recipe_name", "filter_fqns", "emulate", "model_compile_enabled"}
TORCHTITAN_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")

TORCHTITAN_POLICIES = {
    "fp32": Policy(mode="fp32"),
    "tf32": Policy(mode="tf32", micro_batch_size=2, grad_accum_steps=4),
    "bf16-mixed": Policy(mode="bf16-mixed", micro_batch_size=4, grad_accum_steps=2, grad_clip_norm=1.0),
    "bf16-true": Policy(mode="bf16-true", grad_accum_steps=3),
    "fp8-rowwise": Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="rowwise"), micro_batch_size=8, grad_accum_steps=1),
}


@pytest.mark.parametrize("name", list(TORCHTITAN_POLICIES))
def test_torchtitan_snippet_sets_only_its_config_fields(name: str) -> None:
    """torchtitan is not installable from PyPI at the version this export writes for (its
    Python config came after its 0.2 release), so the snippet runs against its fields."""
    policy = TORCHTITAN_POLICIES[name]
    export = export_policy(policy, "torchtitan", device="cuda")
    tree = ast.parse(export.text)
    converters = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and ast.unparse(node.func) == "Float8LinearConverter.Config"]
    if policy.mode == "fp8-torchao":
        (call,) = converters
        keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        assert set(keywords) <= TORCHTITAN_FLOAT8_FIELDS
        assert keywords["recipe_name"] in TORCHTITAN_FLOAT8_RECIPES and keywords["filter_fqns"] == []
        # Run the rest: the converter's import stands in for torchtitan's.
        text = export.text.replace("from torchtitan.components.quantization import Float8LinearConverter", "")
        namespace = {"Float8LinearConverter": type("Float8LinearConverter", (), {"Config": staticmethod(dict)})}
        exec(compile(text, "<torchtitan export>", "exec"), namespace)
    else:
        assert not converters
        with tf32_restored(export.data["tf32"]):
            namespace = run_export(export)
    config = type("TrainerConfig", (), {})()
    config.training = TorchtitanTrainingConfig()
    degree = 2
    kwargs = {"data_parallel_degree": degree} if (policy.grad_accum_steps or 1) > 1 else {}
    assert namespace["apply_mpadvise_policy"](config, **kwargs) is config
    training = config.training
    for field in dataclasses.fields(training):
        allowed = get_args(field.type) if "Literal" in str(field.type) else ()
        if allowed:
            assert getattr(training, field.name) in allowed, field.name
    assert training.dtype == export.data["training"]["dtype"]
    assert training.mixed_precision_param == export.data["training"]["mixed_precision_param"]
    assert training.max_norm == export.data["training"]["max_norm"]
    micro, accum = policy.micro_batch_size, policy.grad_accum_steps or 1
    micro_tokens = micro * 2048 if micro is not None else 16384
    assert training.num_tokens_per_microbatch_per_dp_rank == micro_tokens
    assert training.num_tokens_per_train_step == (micro_tokens * accum * degree if accum > 1 else -1)
