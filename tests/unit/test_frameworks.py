"""Framework scripts: detection from imports, what each framework can express, and the search
space limits that follow (pure: no framework is imported)."""

from __future__ import annotations

import pytest

from advisor.frameworks import (
    FRAMEWORKS,
    LOOP_API,
    detect_framework,
    detect_script_framework,
    plan_for,
    refusal,
    space_limits,
    traits,
)
from advisor.frameworks._accelerate import accelerate_settings
from advisor.frameworks._lightning import lightning_precision
from advisor.frameworks._transformers import (
    accelerator_precision,
    expected_autocast,
    transformers_precision,
)
from advisor.tune._options import TuneOptions
from advisor.tune._space import Candidate, SpaceLimits, space_for
from policies import (
    AutocastMode,
    Fp8Options,
    LossScale,
    Policy,
    mode_names,
    register_mode,
    unregister_mode,
)
from probes import MpadviseError, UsageError


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import lightning as L\ntrainer = L.Trainer(max_steps=3)\n", "lightning"),
        ("import lightning.pytorch as pl\npl.Trainer()\n", "lightning"),
        ("from lightning.pytorch import Trainer\n", "lightning"),
        ("from pytorch_lightning import Trainer, LightningModule\n", "lightning"),
        ("from lightning import pytorch as pl\npl.Trainer()\n", "lightning"),
        ("import lightning as L\nfabric = L.Fabric(accelerator='cpu')\n", "fabric"),
        ("from lightning.fabric import Fabric\n", "fabric"),
        ("from lightning_fabric import Fabric\n", "fabric"),
        ("from transformers import Trainer, TrainingArguments\n", "transformers"),
        ("from transformers import Seq2SeqTrainer\n", "transformers"),
        ("from accelerate import Accelerator\n", "accelerate"),
        # An HF model trained by a Lightning Trainer is a Lightning script.
        ("from transformers import BertConfig\nfrom lightning.pytorch import Trainer\n", "lightning"),
        # Accelerate under an HF Trainer script (the Trainer runs the loop).
        ("from accelerate import Accelerator\nfrom transformers import Trainer\n", "transformers"),
        # The loop API wins: the script applies its policy itself.
        ("import advisor\nfrom lightning.pytorch import Trainer\n", LOOP_API),
        ("from advisor import load_policy\n", LOOP_API),
        # Only models from transformers, trained by hand: no framework trainer.
        ("from transformers import BertConfig, BertModel\nimport torch\n", None),
        ("import torch\n", None),
        ("def broken(:\n", None),
        # Layouts that name the Trainer's own module, or run one through LightningCLI.
        ("from lightning.pytorch.trainer import Trainer\n", "lightning"),
        ("from lightning.pytorch.trainer.trainer import Trainer\n", "lightning"),
        ("from pytorch_lightning.trainer import Trainer\n", "lightning"),
        ("import lightning.pytorch.trainer as tr\ntr.Trainer()\n", "lightning"),
        ("import lightning.pytorch\nlightning.pytorch.Trainer()\n", "lightning"),
        ("from lightning.pytorch.cli import LightningCLI\nLightningCLI(Model)\n", "lightning"),
        ("from pytorch_lightning.cli import LightningCLI\n", "lightning"),
        ("import lightning.pytorch.cli as cli\ncli.LightningCLI(Model)\n", "lightning"),
        # LightningCLI runs a Trainer, which outranks a Fabric imported beside it.
        ("from lightning.fabric import Fabric\nfrom lightning.pytorch.cli import LightningCLI\n", "lightning"),
    ],
)
def test_the_framework_is_read_from_the_imports(source, expected):
    assert detect_framework(source) == expected


def test_every_framework_has_traits_and_fp32():
    for name in FRAMEWORKS:
        t = traits(name)
        assert t.name == name and "fp32" in t.modes
        assert all(m in mode_names() for m in t.modes)


@pytest.mark.parametrize(
    ("policy", "framework", "needle"),
    [
        (Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=1024.0)), "transformers",
         "cannot apply a static loss scale"),
        (Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=256.0)), "transformers",
         "cannot set GradScaler's init_scale"),
        (Policy(mode="bf16-true"), "transformers", "cannot apply mode bf16-true"),
        (Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4), "lightning",
         "cannot change the micro-batch"),
        (Policy(mode="fp8-te", fp8=Fp8Options(recipe="current")), "accelerate", "cannot build the fp8-te recipe 'current'"),
        (Policy(mode="fp8-torchao"), "lightning", "cannot apply mode fp8-torchao"),
        (Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static")), "accelerate", "static loss scale"),
    ],
)
def test_what_a_framework_cannot_express_is_refused_with_the_reason(policy, framework, needle):
    reason = refusal(policy, framework)
    assert reason is not None and needle in reason


@pytest.mark.parametrize(
    ("policy", "framework"),
    [
        (Policy(mode="fp16-mixed"), "transformers"),
        (Policy(mode="bf16-mixed", micro_batch_size=16, grad_accum_steps=4), "transformers"),
        (Policy(mode="fp16-mixed", loss_scale=LossScale(kind="static", init_scale=1024.0)), "lightning"),
        (Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=256.0, growth_interval=500)), "accelerate"),
        (Policy(mode="fp8-te", fp8=Fp8Options(recipe="mxfp8")), "accelerate"),
        (Policy(mode="fp8-te"), "lightning"),
        (Policy(mode="bf16-true"), "fabric"),
    ],
)
def test_what_a_framework_can_express_is_not_refused(policy, framework):
    assert refusal(policy, framework) is None


def test_an_unknown_framework_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown framework 'keras'; expected one of lightning"):
        traits("keras")


def test_the_plan_launches_framework_scripts_through_the_adapter(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer\n")
    plan = plan_for(script)
    assert plan.framework == "transformers" and plan.detected
    assert plan.launch[-2:] == ("advisor.frameworks._boot", "transformers")
    forced = plan_for(script, "accelerate")
    assert forced.framework == "accelerate" and not forced.detected
    script.write_text("import advisor\n")
    assert plan_for(script).framework is None and plan_for(script).launch == ()
    with pytest.raises(MpadviseError, match="cannot read script"):
        plan_for(tmp_path / "missing.py")


def test_a_framework_space_holds_only_what_it_can_apply():
    support = {m: type("S", (), {"supported": True, "emulated": False})() for m in mode_names()}
    hf = space_for(support, 64, limits=space_limits("transformers"))
    assert set(hf.modes) == {"fp32", "tf32", "fp16-mixed", "bf16-mixed"}
    assert hf.micro_batches == (64, 32, 16)
    fp16 = [c for c in hf.grid() if c.mode == "fp16-mixed"]
    # GradScaler's defaults only: one dynamic candidate per micro-batch, no static scale.
    assert {(c.loss_scale, c.init_scale, c.growth_interval) for c in fp16} == {("dynamic", 65536.0, 2000)}
    lightning = space_for(support, 64, limits=space_limits("lightning"))
    assert lightning.micro_batches == (64,) and "fp8-torchao" not in lightning.modes
    assert {c.micro_batch for c in lightning.grid()} == {None}
    assert any(c.loss_scale == "static" for c in lightning.grid())
    # The loop API keeps everything.
    assert space_for(support, 64).limits == SpaceLimits()


def test_limits_refuse_candidates_outside_them():
    limits = space_limits("transformers")
    assert limits.allows(Candidate("fp16-mixed", None, "dynamic", 65536.0, 2000))
    assert not limits.allows(Candidate("fp16-mixed", None, "dynamic", 256.0, 2000))
    assert not limits.allows(Candidate("fp16-mixed", None, "static", 65536.0))
    assert not limits.allows(Candidate("bf16-true"))
    assert not space_limits("accelerate").allows(Candidate("bf16-mixed", 16))


def test_the_framework_option_is_checked_and_travels_with_a_job():
    assert TuneOptions(framework="lightning").to_argv() == ["--framework", "lightning"]
    assert TuneOptions(nproc_per_node=2).to_argv() == ["--nproc-per-node", "2"]
    assert "framework" in TuneOptions().to_dict(job=True) and "nproc_per_node" not in TuneOptions().to_dict(job=True)


def test_what_a_framework_applies_on_cuda_only_is_refused_and_left_out_on_a_cpu():
    fp16 = Policy(mode="fp16-mixed")
    assert refusal(fp16, "transformers") is None  # the device left out of the judgement
    assert refusal(fp16, "transformers", device="cuda:0") is None
    assert "on cpu it would silently train in fp32" in refusal(fp16, "transformers", device="cpu")
    assert "fp16-mixed" not in space_limits("transformers", device="cpu").modes
    assert "fp16-mixed" in space_limits("transformers", device="cuda:0").modes
    # Accelerate's adapter turns CPU fp16 autocast on itself: nothing is left out there.
    assert "fp16-mixed" in space_limits("accelerate", device="cpu").modes


def test_clipping_and_no_loss_scaling_are_refused_where_the_framework_cannot_apply_them():
    clipped = Policy(mode="bf16-mixed", grad_clip_norm=1.0)
    assert refusal(clipped, "lightning") is None and refusal(clipped, "transformers") is None
    assert "leaves gradient clipping to the script" in refusal(clipped, "fabric")
    assert "leaves gradient clipping to the script" in refusal(clipped, "accelerate")
    unscaled = Policy(mode="fp16-mixed", loss_scale=LossScale(kind="none"))
    assert refusal(unscaled, "lightning") is None and refusal(unscaled, "accelerate") is None
    assert "the policy has no loss scaling" in refusal(unscaled, "transformers")


def test_a_mode_the_framework_lacks_here_is_named_as_such(tmp_path):
    from advisor.frameworks import check_plan_modes

    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer\n")
    with pytest.raises(MpadviseError, match="cannot apply mode fp16-mixed here; it can apply fp32, tf32, bf16-mixed"):
        check_plan_modes(plan_for(script, device="cpu"), ["fp16-mixed"])
    with pytest.raises(MpadviseError, match="cannot apply mode bf16-true; it can apply"):
        check_plan_modes(plan_for(script, device="cpu"), ["bf16-true"])


@pytest.mark.parametrize(
    ("helper", "script", "expected"),
    [
        # A Fabric built in a helper module beside the script.
        ("from lightning.fabric import Fabric\ndef make():\n    return Fabric()\n",
         "from setup_fabric import make\nfabric = make()\n", "fabric"),
        ("import lightning as L\ndef make():\n    return L.Trainer()\n", "import setup_fabric\n", "lightning"),
        ("from accelerate import Accelerator\n", "from setup_fabric import *\n", "accelerate"),
        # The helper's framework joins the script's, and precedence decides.
        ("from transformers import Trainer\n", "from accelerate import Accelerator\nimport setup_fabric\n",
         "transformers"),
        # A helper that uses the loop API makes the script a loop-API script.
        ("from advisor import load_policy\n", "from lightning.fabric import Fabric\nimport setup_fabric\n", LOOP_API),
        # A module of that name the script never imports is not read: a plain torch script.
        ("from lightning.fabric import Fabric\n", "import torch\n", "torch"),
    ],
)
def test_a_framework_built_in_a_helper_module_beside_the_script_is_found(tmp_path, helper, script, expected):
    (tmp_path / "setup_fabric.py").write_text(helper)
    path = tmp_path / "train.py"
    path.write_text(script)
    assert detect_script_framework(path) == expected
    assert plan_for(path).framework == (None if expected in (None, LOOP_API) else expected)


def test_helper_packages_beside_the_script_are_read_one_level_deep(tmp_path):
    package = tmp_path / "trainers"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "build.py").write_text("from lightning_fabric import Fabric\nimport deeper\n")
    (tmp_path / "deeper.py").write_text("from transformers import Trainer\n")
    script = tmp_path / "train.py"
    script.write_text("from trainers.build import make\n")
    assert detect_framework(script.read_text()) is None  # the script's source alone names none
    # trainers/build.py is read; deeper.py, imported only by the helper, is not.
    assert detect_script_framework(script) == "fabric"
    script.write_text("from trainers import build\n")
    assert detect_script_framework(script) == "fabric"
    with pytest.raises(MpadviseError, match="cannot read script"):
        detect_script_framework(tmp_path / "missing.py")


class Bf16Demo(AutocastMode):
    """A throwaway mode with bf16-mixed's facts and a name no adapter knows."""

    name = "bf16-demo"
    dtype_family = "bf16"
    safety_rank = 21

    @classmethod
    def support(cls, profile):
        raise AssertionError("not asked in these tests")


@pytest.fixture
def bf16_demo():
    register_mode(Bf16Demo)
    yield Bf16Demo
    unregister_mode("bf16-demo")


def test_a_mode_registered_later_is_applied_by_every_framework_that_can_express_its_facts(bf16_demo):
    for name in ("lightning", "fabric", "transformers", "accelerate"):
        assert "bf16-demo" in traits(name).modes, name
        assert "bf16-demo" in space_limits(name).modes, name
    policy = Policy(mode="bf16-demo")
    assert refusal(policy, "transformers") is None and refusal(policy, "lightning") is None
    assert lightning_precision(policy).precision == "bf16-mixed" and lightning_precision(policy).plugin is None
    assert accelerate_settings(policy).mixed_precision == "bf16"
    assert transformers_precision(policy) == {"fp16": False, "bf16": True, "tf32": False}
    assert expected_autocast("bf16-demo") == "bfloat16" and accelerator_precision("bf16-demo") == "bf16"


def test_the_translations_follow_the_facts_of_each_builtin_mode():
    lightning = {m: lightning_precision(Policy(mode=m)).precision for m in traits("lightning").modes}
    assert lightning == {"fp32": "32-true", "tf32": "32-true", "fp16-mixed": "16-mixed", "bf16-mixed": "bf16-mixed",
                         "fp16-true": "16-true", "bf16-true": "bf16-true", "fp8-te": "transformer-engine"}
    assert lightning_precision(Policy(mode="tf32")).tf32 is True and lightning_precision(Policy(mode="fp32")).tf32 is False
    accelerate = {m: accelerate_settings(Policy(mode=m)).mixed_precision for m in traits("accelerate").modes}
    assert accelerate == {"fp32": "no", "tf32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "fp8-te": "fp8",
                          "fp8-torchao": "fp8"}
    assert transformers_precision(Policy(mode="tf32")) == {"fp16": False, "bf16": False, "tf32": True}
    for mode in ("bf16-true", "fp8-te"):
        with pytest.raises(MpadviseError, match=f"Hugging Face Trainer cannot apply mode {mode}"):
            transformers_precision(Policy(mode=mode))


def test_a_mode_registered_later_is_exported_to_every_target_as_its_facts_say(bf16_demo):
    """No exporter names a mode: one with bf16-mixed's facts exports exactly as bf16-mixed does."""
    from advisor.frameworks import EXPORT_TARGETS, export_policy

    for target in EXPORT_TARGETS:
        demo = export_policy(Policy(mode="bf16-demo"), target, device="cuda")
        mixed = export_policy(Policy(mode="bf16-mixed"), target, device="cuda")
        assert demo.text.replace("bf16-demo", "bf16-mixed") == mixed.text, target
        assert [w.id for w in demo.warnings] == [w.id for w in mixed.warnings], target
