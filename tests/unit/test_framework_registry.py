"""The frameworks registry: a framework is one adapter class and one ``register_framework`` line,
and every list of frameworks (detection, the --framework check, the search-space limits, the
plan's label, the export targets) is derived from it (pure: no framework is imported)."""

from __future__ import annotations

from typing import ClassVar

import pytest

import advisor.frameworks as frameworks
from advisor.frameworks import (
    LOOP_API,
    Export,
    Exporter,
    FrameworkAdapter,
    _registry,
    check_framework,
    check_target,
    detect_framework,
    export_policy,
    export_targets,
    framework_class,
    framework_classes,
    plan_for,
    register_export_target,
    register_framework,
    space_limits,
    traits,
)
from policies import Policy, mode_classes
from probes import UsageError


class ComposerExporter(Exporter):
    target = "composer"
    title = "the Composer Trainer"

    def export(self, policy, *, traits, device, source):
        return Export("composer", f"precision={policy.mode}\n", "text", {"traits": traits.name}, (), ())


class Composer(FrameworkAdapter):
    """A throwaway framework: MosaicML's Composer Trainer, bf16 autocast only."""

    name = "composer"
    label = "the Composer Trainer"
    detected_by: ClassVar = {"composer": ("Trainer",)}
    precedence = 50
    autocasts = ("bf16",)
    sets_micro_batch = True

    @classmethod
    def install(cls, policy, *, recorder, device):
        raise AssertionError("not run in these tests")


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """The registry as it stands, given back after each test: what a test registers is gone again."""
    monkeypatch.setattr(_registry, "_FRAMEWORKS", dict(_registry._FRAMEWORKS))
    monkeypatch.setattr(_registry, "_EXPORTERS", dict(_registry._EXPORTERS))


@pytest.fixture
def composer():
    return register_framework(Composer, exporter=ComposerExporter)


def test_a_registered_framework_is_detected_checked_planned_searched_and_exported(composer, tmp_path):
    assert detect_framework("from composer import Trainer\n") == "composer"
    assert detect_framework("import composer\ncomposer.Trainer(model)\n") == "composer"
    assert check_framework("composer") == "composer"
    assert "composer" in frameworks.FRAMEWORKS
    script = tmp_path / "train.py"
    script.write_text("from composer import Trainer\n")
    detected, forced = plan_for(script), plan_for(script, "composer")
    assert detected.framework == forced.framework == "composer" and detected.detected and not forced.detected
    assert detected.label == "the Composer Trainer" and detected.launch[-1] == "composer"
    limits = space_limits("composer")
    assert limits.modes == ("fp32", "tf32", "bf16-mixed") and limits.micro_batch and limits.why == "the Composer Trainer"
    assert "composer" in export_targets() and "composer" in frameworks.EXPORT_TARGETS
    assert check_target("composer") == "composer"
    exported = export_policy(Policy(mode="bf16-mixed"), "composer")
    assert exported.text == "precision=bf16-mixed\n" and exported.data == {"traits": "composer"}


def test_a_framework_taken_out_of_the_registry_is_gone_everywhere(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(_registry, "_FRAMEWORKS", dict(_registry._FRAMEWORKS))
        patch.setattr(_registry, "_EXPORTERS", dict(_registry._EXPORTERS))
        register_framework(Composer, exporter=ComposerExporter)
        assert detect_framework("from composer import Trainer\n") == "composer"
    assert detect_framework("from composer import Trainer\n") is None
    assert "composer" not in frameworks.FRAMEWORKS and "composer" not in export_targets()
    with pytest.raises(UsageError, match="unknown framework 'composer'; expected one of lightning"):
        check_framework("composer")
    with pytest.raises(UsageError, match="unknown export target 'composer'; expected one of lightning"):
        check_target("composer")


def test_precedence_decides_between_two_frameworks(composer):
    # Composer runs the loop over an Accelerator here: its precedence (50) loses to
    # Accelerate's (40), as declared.
    assert detect_framework("from composer import Trainer\nfrom accelerate import Accelerator\n") == "accelerate"
    assert detect_framework("from composer import Trainer\nimport advisor\n") == LOOP_API


def test_every_derived_list_agrees_with_the_registry():
    classes = framework_classes()
    names = tuple(cls.name for cls in classes)
    assert frameworks.FRAMEWORKS == names == ("lightning", "fabric", "transformers", "accelerate", "torch")
    assert frameworks.EXPORT_TARGETS == (*names, "deepspeed", "torchtitan")
    registered_modes = [cls.name for cls in mode_classes()]
    for cls in classes:
        assert framework_class(cls.name) is cls
        t = traits(cls.name)
        assert t.name == cls.name and t.modes == cls.modes()
        assert list(t.modes) == [m for m in registered_modes if m in t.modes]  # registration order
        limits = space_limits(cls.name)
        assert limits.modes == t.modes and limits.why == cls.label
        assert limits.micro_batch == t.sets_micro_batch and limits.loss_scale_kinds == t.loss_scale_kinds
        for module, imported in cls.detected_by.items():
            for name in imported:
                source = f"from {module} import {name}\n"
                # Detected as this framework, or one that outranks it for the same import.
                found = detect_framework(source)
                assert found == cls.name or framework_class(found).precedence < cls.precedence, source


def test_registration_errors_name_the_attribute_and_the_fix():
    with pytest.raises(TypeError, match="is not a FrameworkAdapter subclass"):
        register_framework(object)

    class Nameless(FrameworkAdapter):
        pass

    with pytest.raises(ValueError, match="name None is not allowed"):
        register_framework(Nameless)

    class Taken(Composer):
        name = "lightning"

    with pytest.raises(ValueError, match="framework 'lightning' is already registered"):
        register_framework(Taken)

    class NoInstall(FrameworkAdapter):
        name, label, detected_by, precedence = "noinstall", "No install", {"x": ("Y",)}, 60

    with pytest.raises(ValueError, match=r"define install\(\)"):
        register_framework(NoInstall)
    with pytest.raises(ValueError, match="writes for 'composer', not 'other'"):
        register_framework(type("Other", (Composer,), {"name": "other"}), exporter=ComposerExporter)
    assert "other" not in frameworks.FRAMEWORKS


def test_an_export_only_target_is_registered_with_its_exporter():
    class Megatron(Exporter):
        target = "megatron"
        title = "Megatron-LM"

        def export(self, policy, *, traits, device, source):
            return Export("megatron", "", "text", {"traits": traits}, (), ())

    register_export_target(Megatron)
    assert export_targets()[-1] == "megatron" and "megatron" not in frameworks.FRAMEWORKS
    assert export_policy(Policy(mode="fp32"), "megatron").data == {"traits": None}
