"""The Accelerate adapter's decisions: what an Accelerator is given for each policy (pure), and
that Accelerate's own kwargs handlers take those fields as they are."""

from __future__ import annotations

import dataclasses
import types

import pytest

from advisor.frameworks import traits
from advisor.frameworks._accelerate import (
    _Application,
    accelerate_settings,
    grad_scaler_kwargs,
    te_recipe_kwargs,
)
from advisor.frameworks._accelerate_record import as_built
from advisor.frameworks._adapter import shift_seed
from policies import Fp8Options, LossScale, Policy, create_mode
from probes import MpadviseError


@pytest.mark.parametrize("mode", traits("accelerate").modes)
def test_every_mode_the_traits_allow_has_settings_with_accelerates_precision(mode):
    settings = accelerate_settings(Policy(mode=mode))
    expected = {"fp32": "no", "tf32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16", "fp8-te": "fp8",
                "fp8-torchao": "fp8"}
    assert settings.mixed_precision == expected[mode]
    # Exactly the mode's own handler; nothing for the modes that need none.
    handlers = {"fp16-mixed": "grad_scaler", "fp8-te": "te_recipe", "fp8-torchao": "torchao_recipe"}
    for field in ("grad_scaler", "te_recipe", "torchao_recipe"):
        assert (getattr(settings, field) is not None) == (handlers.get(mode) == field)


def test_fp32_turns_tf32_off_and_tf32_turns_it_on():
    assert accelerate_settings(Policy(mode="fp32")).tf32 is False
    assert accelerate_settings(Policy(mode="tf32")).tf32 is True
    assert accelerate_settings(Policy(mode="bf16-mixed")).tf32 is None


def test_the_loss_scale_travels_as_grad_scaler_kwargs():
    ls = LossScale(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=50)
    settings = accelerate_settings(Policy(mode="fp16-mixed", loss_scale=ls))
    assert settings.grad_scaler == {"init_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                    "growth_interval": 50}
    assert "GradScalerKwargs(init_scale=1024, growth_factor=4, backoff_factor=0.25, growth_interval=50)" in settings.describe()
    assert grad_scaler_kwargs(LossScale(kind="none")) == {"enabled": False}


def test_a_static_loss_scale_is_refused_with_the_fix():
    with pytest.raises(MpadviseError, match=r"static loss scale.*kind = \"dynamic\""):
        grad_scaler_kwargs(LossScale(kind="static", init_scale=128.0))


def test_accelerates_grad_scaler_kwargs_take_the_fields():
    from accelerate.utils import GradScalerKwargs

    handler = GradScalerKwargs(**grad_scaler_kwargs(LossScale(init_scale=256.0, growth_interval=10)))
    assert handler.to_kwargs() == {"init_scale": 256.0, "growth_interval": 10}


def test_the_delayed_te_recipe_is_the_loop_apis():
    fields = te_recipe_kwargs(Fp8Options(recipe="delayed", fp8_format="e4m3", amax_history_len=16, margin=1))
    # TE's DelayedScaling takes the largest amax of the history; TERecipeKwargs' default differs.
    assert fields == {"fp8_format": "E4M3", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 1}
    assert te_recipe_kwargs(Fp8Options()) == te_recipe_kwargs(Fp8Options(recipe="delayed"))


def test_mxfp8_sets_only_the_switch_accelerate_accepts_for_it():
    # Accelerate refuses amax settings with MXFP8 block scaling (apply_fp8_autowrap).
    assert te_recipe_kwargs(Fp8Options(recipe="mxfp8")) == {"use_mxfp8_block_scaling": True}


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_te_recipes_accelerate_cannot_build_are_refused(recipe):
    with pytest.raises(MpadviseError, match=f"not '{recipe}'.*delayed"):
        te_recipe_kwargs(Fp8Options(recipe=recipe))
    assert traits("accelerate").fp8_recipes["fp8-te"] == ("delayed", "mxfp8")


def test_te_recipe_fields_are_accelerates():
    from accelerate.utils import TERecipeKwargs

    names = {f.name for f in dataclasses.fields(TERecipeKwargs)}
    for recipe in ("delayed", "mxfp8"):
        assert set(te_recipe_kwargs(Fp8Options(recipe=recipe))) <= names


def test_the_torchao_recipe_is_the_policys_or_the_default():
    assert accelerate_settings(Policy(mode="fp8-torchao")).torchao_recipe == "tensorwise"
    policy = Policy(mode="fp8-torchao", fp8=Fp8Options(recipe="rowwise"))
    assert accelerate_settings(policy).torchao_recipe == "rowwise"


@pytest.mark.parametrize(("seed", "shift", "expected"), [(42, 0, 42), (42, 1, 43), (None, 1, None), (True, 1, True)])
def test_the_scripts_seed_moves_by_the_trial_seed(seed, shift, expected):
    seeded, notes = [], []
    utils = types.SimpleNamespace(set_seed=seeded.append)
    recorder = types.SimpleNamespace(spec=types.SimpleNamespace(seed=shift), note=notes.append)
    shift_seed([utils], "set_seed", recorder)
    utils.set_seed(seed)
    assert seeded == [expected]
    assert notes == (["the script's set_seed(42) ran as set_seed(43) (trial seed 1)"] if expected == 43 else [])


def test_a_mode_accelerate_lacks_is_refused():
    with pytest.raises(MpadviseError, match="cannot apply mode bf16-true"):
        accelerate_settings(Policy(mode="bf16-true"))


def test_the_policys_handlers_replace_the_scripts_of_the_same_kind():
    from accelerate.utils import (
        AutocastKwargs,
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        TERecipeKwargs,
    )

    policy = Policy(mode="fp16-mixed", loss_scale=LossScale(init_scale=1024.0))
    application = _Application(policy, accelerate_settings(policy), recorder=None, device=None)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    # A TE recipe the script keeps for its FP8 runs: outside fp8 Accelerate refuses it. (Made
    # without __post_init__, which needs Transformer Engine installed.)
    te = object.__new__(TERecipeKwargs)
    handlers = application._handlers([GradScalerKwargs(init_scale=2.0), ddp, te, AutocastKwargs(enabled=False)])
    kinds = [type(h) for h in handlers]
    assert kinds.count(GradScalerKwargs) == 1 and TERecipeKwargs not in kinds
    assert ddp in handlers  # what has nothing to do with precision stays
    scaler = next(h for h in handlers if isinstance(h, GradScalerKwargs))
    assert scaler.init_scale == 1024.0
    assert next(h for h in handlers if isinstance(h, AutocastKwargs)).enabled


def test_the_fingerprinted_model_is_the_one_the_script_built_before_fp8_swaps_its_layers():
    import torch

    from advisor.runtime._workload import model_signature

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    before = model_signature(model)
    built = as_built(model)
    # The swap Accelerate makes with the AORecipeKwargs the adapter gives it: this mode's
    # config and filter, the same convert_to_float8_training call.
    mode = create_mode(Policy(mode="fp8-torchao"), torch.device("cpu"))
    model = mode.convert_module(model)
    assert mode.converted == ["0"] and model_signature(model) != before
    assert model_signature(built) == before
