"""Policy validation and the TOML config file: round trips and bad input."""

from __future__ import annotations

import pytest

from policies import MODES, Fp8Options, LossScale, Policy, PolicyError, TunedOn, load_config


def test_every_mode_round_trips_through_toml():
    for mode in MODES:
        policy = Policy(mode=mode, micro_batch_size=32, grad_accum_steps=2)
        assert Policy.from_toml(policy.to_toml()) == policy


def test_full_policy_round_trips_with_tuned_on_record():
    policy = Policy(
        mode="fp16-mixed",
        loss_scale=LossScale(kind="static", init_scale=1024.0, growth_interval=500),
        micro_batch_size=16,
        grad_accum_steps=4,
        grad_clip_norm=1.0,
        tuned_on=TunedOn(
            hardware_fingerprint="abcd1234abcd1234",
            device="NVIDIA A100-SXM4-80GB",
            torch="2.13.0",
            libraries=(("torchao", "0.18.0"), ("transformer_engine", None)),
            date="2026-11-30",
            speedup_vs_fp32=1.73,
            trials=12,
        ),
    )
    text = policy.to_toml()
    assert text.splitlines()[3].startswith("schema = 1")
    again = Policy.from_toml(text)
    assert again == policy
    assert again.tuned_on == policy.tuned_on


def test_fp8_options_round_trip():
    policy = Policy(mode="fp8-te", fp8=Fp8Options(recipe="current", fp8_format="e4m3"))
    assert Policy.from_toml(policy.to_toml()) == policy


def test_mode_at_top_level_and_loss_scale_table_in_file():
    text = Policy(mode="fp16-mixed").to_toml()
    assert 'mode = "fp16-mixed"' in text
    assert "[loss_scale]" in text
    assert 'kind = "dynamic"' in text


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mode": "bf17-mixed"}, "mode: 'bf17-mixed' is not allowed; expected one of fp32, tf32"),
        ({"mode": "fp32", "micro_batch_size": 0}, "micro_batch_size: 0"),
        ({"mode": "fp32", "grad_accum_steps": 2.5}, "grad_accum_steps: 2.5"),
        ({"mode": "fp32", "grad_clip_norm": -1.0}, "grad_clip_norm: -1.0"),
        ({"mode": "bf16-mixed", "loss_scale": LossScale()}, "loss scaling applies to fp16-mixed only"),
        ({"mode": "bf16-mixed", "fp8": Fp8Options()}, "FP8 options apply to fp8-te and fp8-torchao only"),
        ({"mode": "fp8-torchao", "fp8": Fp8Options(recipe="delayed")}, "fp8.recipe: 'delayed' is not allowed; expected one of tensorwise"),
    ],
)
def test_validation_names_field_value_and_allowed(kwargs, needle):
    with pytest.raises(PolicyError) as info:
        Policy(**kwargs)
    assert needle in str(info.value)
    assert "Policy." not in str(info.value)  # the key as a config file spells it, not the class


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kind": "adaptive"}, "loss_scale.kind: 'adaptive' is not allowed; expected one of none, static, dynamic"),
        ({"init_scale": 0}, "loss_scale.init_scale: 0"),
        ({"growth_factor": 1.0}, "loss_scale.growth_factor: 1.0"),
        ({"backoff_factor": 1.5}, "loss_scale.backoff_factor: 1.5"),
        ({"growth_interval": 0}, "loss_scale.growth_interval: 0"),
    ],
)
def test_loss_scale_validation(kwargs, needle):
    with pytest.raises(PolicyError) as info:
        LossScale(**kwargs)
    assert needle in str(info.value)


def test_fp16_mixed_defaults_to_dynamic_scaling():
    assert Policy(mode="fp16-mixed").loss_scale == LossScale(kind="dynamic", init_scale=65536.0)


def test_policy_is_frozen_and_hashable():
    policy = Policy(mode="bf16-mixed")
    with pytest.raises(AttributeError):
        policy.mode = "fp32"  # type: ignore[misc]
    assert len({policy, Policy(mode="bf16-mixed")}) == 1


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('mode = "fp32"\nmode = "tf32"\n', "invalid TOML"),
        ("mode = \n", "invalid TOML"),
        ('micro_batch_size = 4\n', "missing 'mode'"),
        ('mode = "fp64"\n', "mode: 'fp64' is not allowed"),
        ('mode = "fp32"\nbatch = 3\n', "unknown field 'batch'"),
        ('schema = 99\nmode = "fp32"\n', "schema 99 is newer than this mpadvise understands"),
        ('mode = "fp16-mixed"\n[loss_scale]\nkind = "dynamic"\ninit_scale = -2.0\n', "loss_scale.init_scale: -2.0"),
        ('mode = "fp16-mixed"\nloss_scale = 3\n', "[loss_scale] must be a table"),
        ('mode = "fp16-mixed"\n[loss_scale]\nscale = 2.0\n', "[loss_scale] has unknown field 'scale'"),
        ('mode = "fp32"\nmicro_batch_size = "big"\n', "micro_batch_size: 'big'"),
    ],
)
def test_bad_files_give_one_line_naming_the_file(tmp_path, text, needle):
    path = tmp_path / "train.mpadvise.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_config(path)
    message = str(info.value)
    assert needle in message
    assert str(path) in message
    assert "\n" not in message
    assert "Policy." not in message  # the key as the file spells it, not the class


def test_missing_unreadable_and_directory_config(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(PolicyError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PolicyError, match="cannot read config file"):
        load_config(binary)


def test_save_is_atomic_and_loadable(tmp_path):
    path = Policy(mode="bf16-mixed", micro_batch_size=8).save(tmp_path / "x.mpadvise.toml")
    assert load_config(path) == Policy(mode="bf16-mixed", micro_batch_size=8)
    assert [p.name for p in tmp_path.iterdir()] == ["x.mpadvise.toml"]
