"""Every export loads back into its own framework, through the framework's own loader, carrying
what was measured (accumulation, clipping, batch): the Lightning Trainer and Fabric run the
emitted code, ``TrainingArguments`` takes the fields with nothing added but ``output_dir``,
Accelerate builds the Accelerator from the emitted code and reads the config file with its own
loader, DeepSpeed parses the JSON with its own ``DeepSpeedConfig``, and torchtitan's
``ConfigManager`` builds a config whose real ``TrainingConfig`` the emitted function sets.

The policies are shaped like real tunes: bf16-mixed keeping the script's batch and
accumulation, a split (micro-batch 16 x 4), one that clips at 1.0, fp32, tf32, and fp16-mixed
with a dynamic loss scale (for CUDA)."""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from advisor.frameworks import export_policy
from advisor.frameworks._export import Export
from policies import Fp8Options, LossScale, Policy, create_mode
from probes import matmul_switches

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


TUNES = {
    "bf16-kept": Policy(mode="bf16-mixed"),
    "bf16-split": Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4),
    "bf16-clip": Policy(mode="bf16-mixed", grad_clip_norm=1.0),
    "fp32": Policy(mode="fp32"),
    "tf32": Policy(mode="tf32"),
    "fp16-dynamic": Policy(mode="fp16-mixed", loss_scale=LossScale()),
}
# The script's own arguments, which a kept policy leaves as they are: an 8 x 2 global batch.
SCRIPT_ARGUMENTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("name", list(TUNES))
def test_training_arguments_take_the_fields(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import TrainingArguments

    policy = TUNES[name]
    device = "cuda" if policy.mode in ("fp16-mixed", "tf32") else DEVICE
    if device == "cuda" and not CUDA:
        pytest.skip(f"{policy.mode}'s export is for CUDA (the HF Trainer cannot run it on a CPU); no GPU here")
    fields = run_export(export_policy(policy, "transformers", device=device))["training_arguments"]
    # The script's own arguments, then the export's: a kept policy adds no second accumulation.
    arguments = {**SCRIPT_ARGUMENTS, **fields}
    args = TrainingArguments(**arguments, output_dir=str(tmp_path))
    for key, value in fields.items():
        assert getattr(args, key) == value, key
    micro, accum = policy.micro_batch_size, policy.grad_accum_steps
    assert args.per_device_train_batch_size == (micro or 8)
    assert args.gradient_accumulation_steps == (accum or 2)
    assert args.max_grad_norm == (policy.grad_clip_norm or 1.0)  # TrainingArguments' own default kept
    assert args.bf16 is (policy.mode == "bf16-mixed") and args.fp16 is (policy.mode == "fp16-mixed")
    assert args.use_cpu is (device == "cpu")


def test_training_arguments_merge_with_the_scripts_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The script's call ``TrainingArguments(**script, **export)`` must not repeat a keyword."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import TrainingArguments

    fields = export_policy(TUNES["bf16-kept"], "transformers", device=DEVICE).data["training_arguments"]
    args = TrainingArguments(output_dir=str(tmp_path), **SCRIPT_ARGUMENTS, **fields)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16


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
    **{name: TUNES[name] for name in ("bf16-kept", "bf16-split", "bf16-clip", "fp32", "tf32")},
    "fp16-default": TUNES["fp16-dynamic"],
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
    # The config file, through accelerate's own loader (it refuses unknown keys): the one the
    # code shows in a comment, and the one `--out FILE.yaml` writes where it carries the policy.
    config_path = tmp_path / "accelerate.yaml"
    config_path.write_text(export.data["config_file_yaml"], encoding="utf-8")
    config = load_config_from_file(str(config_path))
    assert config.mixed_precision == export.data["config_file"]["mixed_precision"]
    assert config.use_cpu is (DEVICE == "cpu")
    alternate = export.alternates["yaml"]
    if isinstance(alternate, Export):
        config_path.write_text(export.for_file(config_path).text, encoding="utf-8")
        assert load_config_from_file(str(config_path)) == config
    else:  # the policy needs code (kwargs handlers, TF32 switches): `--out FILE.yaml` refuses
        assert "cannot carry" in alternate and name in ("fp32", "tf32", "fp16-default", "fp16-dynamic", "fp16-none")
    policy = ACCELERATE_POLICIES[name]
    assert accelerator.gradient_accumulation_steps == (policy.grad_accum_steps or 1)
    if policy.grad_clip_norm is not None:
        assert f"accelerator.clip_grad_norm_(model.parameters(), {policy.grad_clip_norm!r})" in export.text
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
    **{name: TUNES[name] for name in ("bf16-kept", "bf16-split", "bf16-clip", "fp32", "tf32", "fp16-dynamic")},
    "fp16-split": Policy(mode="fp16-mixed", micro_batch_size=4, grad_accum_steps=8),
}
# What the notes tell a user of a kept policy to add: the script's own 8 x 2, clipping at 1.0.
SCRIPT_DEEPSPEED = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}


@pytest.mark.parametrize("name", list(DEEPSPEED_POLICIES))
def test_deepspeed_parses_the_config(name: str) -> None:
    pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed (pip install deepspeed)")
    from deepspeed.runtime.config import DeepSpeedConfig

    policy = DEEPSPEED_POLICIES[name]
    export = export_policy(policy, "deepspeed", device="cuda")
    config = json.loads(export.text)
    # A kept batch or clipping is the script's: only what a note names is added, as a user would.
    added = {key: value for key, value in SCRIPT_DEEPSPEED.items() if key not in config}
    for key in added:
        assert any(f"add {key}" in note for note in export.notes), key
    parsed = DeepSpeedConfig({**config, **added})
    micro, accum = policy.micro_batch_size, policy.grad_accum_steps
    assert parsed.train_micro_batch_size_per_gpu == (micro or 8)
    assert parsed.gradient_accumulation_steps == (accum or 2)
    assert parsed.train_batch_size == (micro or 8) * (accum or 2)  # one process
    assert parsed.gradient_clipping == (policy.grad_clip_norm or 1.0)
    assert not parsed.float16_config.enabled and not parsed.bfloat16_config.enabled
    expected_dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(policy.mode)
    assert parsed.torch_autocast_enabled is (expected_dtype is not None)
    if expected_dtype is not None:
        assert parsed.torch_autocast_dtype == expected_dtype
        assert parsed.torch_autocast_lower_precision_safe_modules == []


def test_a_split_deepspeed_config_loads_as_written() -> None:
    pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed (pip install deepspeed)")
    from deepspeed.runtime.config import DeepSpeedConfig

    policy = Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4, grad_clip_norm=1.0)
    parsed = DeepSpeedConfig(json.loads(export_policy(policy, "deepspeed", device="cuda").text))
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (16, 4)
    assert parsed.gradient_clipping == 1.0


# ---- torchtitan -------------------------------------------------------------------------------

TORCHTITAN_POLICIES = {
    **{name: TUNES[name] for name in ("bf16-kept", "bf16-split", "bf16-clip", "fp32", "tf32")},
    "bf16-true": Policy(mode="bf16-true", grad_accum_steps=3),
    "fp8-rowwise": Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="rowwise"), micro_batch_size=8, grad_accum_steps=1),
}

# A config_registry module as torchtitan's ConfigManager loads one (--module, --config), whose
# config holds torchtitan's own TrainingConfig and ParallelismConfig: its Trainer.Config needs
# torchtitan's whole model and data stack, its training section is this class.
REGISTRY = """
from dataclasses import dataclass, field

from torchtitan.config import ParallelismConfig, TrainingConfig


@dataclass(kw_only=True)
class Config:
    hf_assets_path: str = "."
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)


def small() -> Config:
    return Config(training=TrainingConfig(local_batch_size=8, global_batch_size=32, max_norm=0.5))
"""


def _float8_config_fields() -> set[str]:
    """The fields of torchtitan's ``Float8LinearConverter.Config``, read from its installed source
    (importing it needs triton, a GPU package)."""
    import importlib.util

    root = Path(importlib.util.find_spec("torchtitan").origin).parent / "components" / "quantization"
    fields: set[str] = set()
    for path, owner in ((root / "__init__.py", "QuantizationConverter"), (root / "float8.py", "Float8LinearConverter")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        (cls,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner]
        (config,) = [n for n in cls.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
        fields |= {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}
    return fields


@pytest.mark.parametrize("name", list(TORCHTITAN_POLICIES))
def test_torchtitan_config_manager_takes_the_export(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchtitan.config", reason=(
        "torchtitan is not installed: scripts/bootstrap.sh leaves it out, since its datasets dependency pins a "
        "huggingface-hub older than transformers needs (pip install --no-deps torchtitan spmd_types, then pip install tyro, runs it)"))
    from torchtitan.config import ConfigManager

    (tmp_path / "mpadvise_titan_registry.py").write_text(REGISTRY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", "mpadvise_titan_registry", "--config", "small"])
    policy = TORCHTITAN_POLICIES[name]
    export = export_policy(policy, "torchtitan", device=DEVICE)
    text = export.text
    if export.data["float8"] is not None:
        tree = ast.parse(text)
        (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and ast.unparse(n.func) == "Float8LinearConverter.Config"]
        assert {k.arg for k in call.keywords} <= _float8_config_fields()
        # The converter needs triton to import: the rest runs against torchtitan's own config.
        text = text.replace("from torchtitan.components.quantization import Float8LinearConverter", "")
        names = {"Float8LinearConverter": type("Float8LinearConverter", (), {"Config": staticmethod(dict)})}
    else:
        names = {}
    with tf32_restored(export.data["tf32"]):
        namespace = dict(names)
        exec(compile(text, "<torchtitan export>", "exec"), namespace)
    degree = 2
    kwargs = {"data_parallel_degree": degree} if export.data["grad_accum_steps"] is not None else {}
    assert namespace["apply_mpadvise_policy"](config, **kwargs) is config  # slots: an unknown field raises
    training = config.training
    for key, value in export.data["training"].items():
        assert getattr(training, key) == value, key
    assert training.max_norm == (policy.grad_clip_norm or 0.5)  # never turned off: the config's own kept
    micro, accum = export.data["micro_batch_size"], export.data["grad_accum_steps"]
    assert training.local_batch_size == (micro or 8)
    assert training.global_batch_size == (training.local_batch_size * accum * degree if accum else 32)
