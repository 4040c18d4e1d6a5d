"""Each precision mode is one self-describing class, and every list of modes is read from them.

A contract over every registered mode, then a throwaway mode registered for a test: it must
appear in the config validation, the hardware support table, `mpadvise probe` and the search
space without any other edit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import GPUS, WITHOUT_FP8_LIBRARIES, gpu_profile
from rich.console import Console

import probes
from advisor import _hardware
from advisor.cli._env import render_probe
from advisor.tune._checks import check_modes, default_trial_modes
from advisor.tune._space import Candidate, preference_key, space_for, upper_bound
from advisor.tune._stability import VERDICT_KINDS, TrialCurve, judge
from policies import (
    MODES,
    TE_RECIPES,
    TORCHAO_RECIPES,
    Fp8Options,
    ModeSupport,
    Policy,
    PolicyError,
    PrecisionMode,
    mode_class,
    mode_classes,
    mode_dtypes,
    mode_names,
    register_mode,
    safety_order,
    safety_rank,
    supported_modes,
    unregister_mode,
)
from probes import HardwareProfile, UsageError, cpu_profile
from probes._bench import BENCH_DTYPES

ROOT = Path(__file__).resolve().parents[2]
CPU = replace(
    cpu_profile(Path(__file__).parent / "data" / "cpuinfo" / "zen1_epyc_build_machine.txt"),
    libraries=(("torchao", "0.10.0"), ("transformer_engine", None)),
)
PROFILES = [CPU, *(gpu_profile(key) for key in sorted(GPUS)), gpu_profile("H100", libraries=WITHOUT_FP8_LIBRARIES)]
BUILTIN = (
    "fp32",
    "tf32",
    "fp16-mixed",
    "bf16-mixed",
    "fp16-true",
    "bf16-true",
    "fp8-te",
    "fp8-torchao",
)


# --- the contract every registered mode keeps -------------------------------------------------


def test_the_builtin_modes_in_their_order() -> None:
    assert MODES == mode_names() == BUILTIN
    assert tuple(cls.name for cls in mode_classes()) == BUILTIN


def test_safety_order_is_the_documented_one() -> None:
    text = (ROOT / "docs" / "stability.md").read_text()
    sentence = re.search(r"From\s+safest:(.*?)\.\s", text, re.DOTALL)
    assert sentence is not None, "docs/stability.md no longer states the safety order"
    documented = tuple(re.findall(r"`([^`]+)`", sentence.group(1)))
    assert safety_order() == documented
    assert [safety_rank(m) for m in documented] == sorted(safety_rank(m) for m in documented)


@pytest.mark.parametrize("cls", mode_classes(), ids=lambda cls: cls.name)
def test_every_mode_describes_itself(cls: type[PrecisionMode]) -> None:
    assert mode_class(cls.name) is cls
    assert [c.name for c in mode_classes()].count(cls.name) == 1
    assert [c.safety_rank for c in mode_classes()].count(cls.safety_rank) == 1
    # The search's speed prior looks the family up among the benchmarked dtypes.
    assert cls.dtype_family in BENCH_DTYPES
    assert mode_dtypes()[cls.name] == cls.dtype_family
    assert cls.label().startswith(cls.name)
    for kind in (*VERDICT_KINDS, "climbed"):
        advice = cls.advice(kind)
        assert isinstance(advice, str) and advice.strip()
    assert isinstance(cls.loss_scaling, bool)
    assert all(isinstance(recipe, str) for recipe in cls.fp8_recipes)


@pytest.mark.parametrize("cls", mode_classes(), ids=lambda cls: cls.name)
@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_every_mode_says_where_it_runs(cls: type[PrecisionMode], profile: HardwareProfile) -> None:
    support = cls.support(profile)
    assert isinstance(support, ModeSupport) and support.mode == cls.name
    assert support.reason.startswith(f"{cls.name}: ")
    assert supported_modes(profile)[cls.name] == support


def test_labels_and_knobs_of_the_builtin_modes() -> None:
    labels = {name: mode_class(name).label() for name in BUILTIN}
    assert labels["bf16-true"] == "bf16-true (pure bf16)"
    assert labels["fp16-true"] == "fp16-true (pure fp16)"
    assert all(labels[m] == m for m in BUILTIN if not m.endswith("-true"))
    assert [m for m in BUILTIN if mode_class(m).loss_scaling] == ["fp16-mixed"]
    assert mode_class("fp8-te").fp8_recipes == TE_RECIPES == ("delayed", "current", "mxfp8", "block")
    assert mode_class("fp8-torchao").fp8_recipes == TORCHAO_RECIPES
    assert TORCHAO_RECIPES == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    assert mode_dtypes() == {
        "fp32": "fp32", "tf32": "tf32", "fp16-mixed": "fp16", "bf16-mixed": "bf16",
        "fp16-true": "fp16", "bf16-true": "bf16", "fp8-te": "fp8", "fp8-torchao": "fp8",
    }


def test_the_facts_frameworks_translate() -> None:
    """What each built-in mode does, as adapters and exporters read it (never by name)."""
    from policies import ModeFacts, mode_facts

    assert mode_facts("fp32") == ModeFacts(tf32=False)
    assert mode_facts("tf32") == ModeFacts(tf32=True)
    assert mode_facts("fp16-mixed") == ModeFacts(autocast="fp16", loss_scaling=True)
    assert mode_facts("bf16-mixed") == ModeFacts(autocast="bf16")
    assert mode_facts("fp16-true") == ModeFacts(weights="fp16")
    assert mode_facts("bf16-true") == ModeFacts(weights="bf16")
    assert mode_facts("fp8-te") == ModeFacts(fp8_library="transformer_engine", fp8_default_recipe="delayed")
    assert mode_facts("fp8-torchao") == ModeFacts(fp8_library="torchao", fp8_default_recipe="tensorwise")
    te = mode_facts("fp8-te")
    assert te.fp8_recipe(Policy(mode="fp8-te")) == "delayed"
    assert te.fp8_recipe(Policy(mode="fp8-te", fp8=Fp8Options(recipe="mxfp8"))) == "mxfp8"
    assert mode_facts("bf16-mixed").fp8_recipe(Policy(mode="bf16-mixed")) is None


def test_a_mode_of_a_family_inherits_its_facts() -> None:
    from policies import AutocastMode, TrueHalfMode

    class Fp16Again(AutocastMode):
        name, dtype_family, safety_rank = "fp16-again", "fp16", 31

    class Bf16Pure(TrueHalfMode):
        name, dtype_family, safety_rank = "bf16-pure", "bf16", 61

    assert Fp16Again.facts().autocast == "fp16" and Fp16Again.facts().weights == "fp32"
    assert Bf16Pure.facts().weights == "bf16" and Bf16Pure.facts().autocast is None


def test_each_fp8_mode_checks_its_own_recipes() -> None:
    Policy(mode="fp8-te", fp8=Fp8Options(recipe="mxfp8"))
    with pytest.raises(PolicyError, match=r"^fp8\.recipe: 'rowwise' is not allowed; expected one of delayed, .* \(the recipes of fp8-te\)$"):
        Policy(mode="fp8-te", fp8=Fp8Options(recipe="rowwise"))


# --- registering a mode -----------------------------------------------------------------------


class Int8Demo(PrecisionMode):
    """A mode that exists only in these tests: trains like fp32, claims to run everywhere."""

    name = "int8-demo"
    dtype_family = "int8"
    safety_rank = 35  # between fp16-mixed (30) and fp8-torchao (40)

    @classmethod
    def support(cls, profile: HardwareProfile) -> ModeSupport:
        return ModeSupport(cls.name, True, f"{cls.name}: runs anywhere (a test mode)")


@pytest.fixture
def demo_mode() -> Iterator[type[PrecisionMode]]:
    register_mode(Int8Demo)
    try:
        yield Int8Demo
    finally:
        unregister_mode(Int8Demo.name)


def test_a_registered_mode_is_listed_everywhere(demo_mode) -> None:
    import policies

    assert policies.MODES == (*BUILTIN, "int8-demo")
    assert safety_order().index("int8-demo") == safety_order().index("fp16-mixed") + 1
    assert safety_rank("fp16-mixed") < safety_rank("int8-demo") < safety_rank("fp8-torchao")


def test_a_registered_mode_is_gone_once_removed() -> None:
    register_mode(Int8Demo)
    unregister_mode("int8-demo")
    assert mode_names() == BUILTIN
    with pytest.raises(ValueError, match="'int8-demo' has no safety rank"):
        safety_rank("int8-demo")


def test_config_validation_accepts_a_registered_mode(demo_mode) -> None:
    policy = Policy(mode="int8-demo", micro_batch_size=8)
    assert Policy.from_toml('mode = "int8-demo"\nmicro_batch_size = 8\n') == policy
    assert Policy.from_toml(policy.to_toml()) == policy
    with pytest.raises(PolicyError) as info:
        Policy(mode="int9-demo")
    assert str(info.value) == (
        "mode: 'int9-demo' is not allowed; expected one of fp32, tf32, fp16-mixed, "
        "bf16-mixed, fp16-true, bf16-true, fp8-te, fp8-torchao, int8-demo"
    )
    with pytest.raises(PolicyError, match="FP8 options apply to fp8-te and fp8-torchao only, not 'int8-demo'"):
        Policy(mode="int8-demo", fp8=Fp8Options())


def test_an_unknown_mode_fails_with_the_same_message() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_toml('mode = "int8-demo"\n', source="train.mpadvise.toml")
    assert str(info.value) == (
        "train.mpadvise.toml: mode: 'int8-demo' is not allowed; expected one of fp32, "
        "tf32, fp16-mixed, bf16-mixed, fp16-true, bf16-true, fp8-te, fp8-torchao"
    )
    with pytest.raises(UsageError, match="unknown mode 'int8-demo'; expected one of fp32, tf32"):
        check_modes(["int8-demo"], CPU)


def test_the_support_table_and_probe_report_list_a_registered_mode(demo_mode, monkeypatch) -> None:
    support = supported_modes(CPU)
    assert tuple(support) == (*BUILTIN, "int8-demo")
    assert support["int8-demo"] == ModeSupport("int8-demo", True, "int8-demo: runs anywhere (a test mode)")
    assert check_modes(["int8-demo"], CPU) == ["int8-demo"]
    assert "int8-demo" in default_trial_modes(CPU)

    monkeypatch.setattr(probes, "detect", lambda: [CPU])
    monkeypatch.setattr(probes, "primary_profile", lambda: CPU)
    report = _hardware.probe_report()
    modes = report["devices"][0]["modes"]
    assert list(modes) == [*BUILTIN, "int8-demo"]
    assert modes["int8-demo"] == {
        "supported": True,
        "emulated": False,
        "reason": "int8-demo: runs anywhere (a test mode)",
    }
    console = Console(record=True, width=200, color_system=None)
    render_probe(report, console)
    assert "int8-demo: runs anywhere (a test mode)" in console.export_text()


def test_the_search_space_holds_a_registered_mode(demo_mode) -> None:
    space = space_for(supported_modes(CPU), 32)
    assert "int8-demo" in space.modes
    grid = space.grid()
    assert Candidate("int8-demo") in grid and Candidate("int8-demo", 16) in grid
    assert Candidate("int8-demo", 16).policy(32) == Policy(mode="int8-demo", micro_batch_size=16, grad_accum_steps=2)
    # Ties between equally fast candidates go by the class's safety rank.
    ranked = sorted([Candidate("fp8-torchao"), Candidate("int8-demo"), Candidate("fp16-mixed")],
                    key=lambda c: preference_key(c, 32))
    assert [c.mode for c in ranked] == ["fp16-mixed", "int8-demo", "fp8-torchao"]
    # No benchmark covers int8 here: no prior bounds it.
    assert upper_bound(Candidate("int8-demo"), {}, user_batch=32, reference_goodput=100.0,
                       dtype_ratio={"fp32": 1.0, "bf16": 0.4}) == float("inf")


def test_stability_reasons_use_a_registered_mode_s_label_and_advice(demo_mode, monkeypatch) -> None:
    monkeypatch.setattr(Int8Demo, "label", classmethod(lambda cls: "int8-demo (integer matmuls)"))
    monkeypatch.setattr(Int8Demo, "advice", classmethod(lambda cls, kind, **facts: f"advice for {kind}"))
    losses = [1.0 / (1 + i / 10) for i in range(100)]
    verdict = judge(TrialCurve("int8-demo", tuple([*losses[:50], float("nan"), *losses[51:]])), TrialCurve("fp32", tuple(losses)))
    assert verdict.kind == "diverged"
    assert verdict.reason.startswith("int8-demo (integer matmuls) diverged: loss became NaN at step 51")
    assert verdict.reason.endswith("; advice for diverged")


# --- what register_mode refuses ---------------------------------------------------------------


def _mode(**attributes: object) -> type[PrecisionMode]:
    body = {"name": "int8-demo", "dtype_family": "int8", "safety_rank": 35, "support": Int8Demo.support}
    body.update(attributes)
    return type("Broken", (PrecisionMode,), {k: v for k, v in body.items() if v is not None})


@pytest.mark.parametrize(
    ("cls", "error", "needle"),
    [
        (object, TypeError, "is not a PrecisionMode subclass; derive the mode's class from policies.PrecisionMode"),
        (_mode(name="fp32"), ValueError, "mode 'fp32' is already registered by Fp32; give the class a name of its own"),
        (_mode(name=""), ValueError, "name '' is not allowed"),
        (_mode(dtype_family=None), ValueError, "dtype_family None is not allowed; set it to the dtype"),
        (_mode(safety_rank=20), ValueError, "safety_rank 20 is already bf16-mixed's; pick an unused rank"),
        (_mode(safety_rank="high"), ValueError, "safety_rank 'high' is not allowed; set an integer"),
        (_mode(support=None), ValueError, "does not say where it runs; define support(profile)"),
    ],
)
def test_register_mode_refuses_an_incomplete_or_clashing_class(cls, error, needle) -> None:
    with pytest.raises(error) as info:
        register_mode(cls)
    assert needle in str(info.value)
    assert mode_names() == BUILTIN
