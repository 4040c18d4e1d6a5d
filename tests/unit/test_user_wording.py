"""What a user reads names things in a user's words: the devices there are (not a count of
none), and what an export for CUDA means on a machine without one."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

import probes
from advisor.cli import app
from probes import UsageError


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, faked at the hardware boundary."""
    monkeypatch.setattr(probes, "cuda_profiles", lambda: [])
    monkeypatch.setattr(probes, "primary_profile", probes.cpu_profile)


@pytest.fixture
def two_gpus(monkeypatch):
    gpu = probes.HardwareProfile(kind="cuda", name="NVIDIA H100", index=0, compute_capability=(9, 0))
    gpus = [gpu, dataclasses.replace(gpu, index=1)]
    monkeypatch.setattr(probes, "cuda_profiles", lambda: gpus)
    monkeypatch.setattr(probes, "primary_profile", lambda: gpus[0])


def test_a_missing_cuda_device_says_there_is_none(no_cuda):
    with pytest.raises(UsageError) as caught:
        probes.profile_for("cuda:0")
    assert str(caught.value) == "device 'cuda:0' is not available: no CUDA device here; use --device cpu"
    assert caught.value.exit_code == 2


def test_a_missing_cuda_device_names_those_there_are(two_gpus):
    with pytest.raises(UsageError, match=r"^device 'cuda:5' is not available: the CUDA devices here are cuda:0, cuda:1$"):
        probes.profile_for("cuda:5")
    assert probes.profile_for("cuda:1").index == 1 and probes.profile_for("cuda").index == 0


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cuda:-1", "gpu", "cudafoo", "CPU0"])
def test_a_device_of_another_form_is_one_usage_error(device, no_cuda):
    with pytest.raises(UsageError, match=rf"^device '{device}' is not allowed; expected 'cpu', 'cuda' or 'cuda:N'$"):
        probes.profile_for(device)


def _config(tmp_path, text='mode = "bf16-mixed"\n'):
    path = tmp_path / "a.mpadvise.toml"
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_an_export_for_cuda_says_what_it_means_without_cuda(tmp_path, no_cuda):
    result = CliRunner().invoke(app, ["export", str(_config(tmp_path)), "--to", "lightning"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "note: these settings are for CUDA (a config file without [tuned_on] is taken to be for a GPU); this machine "
        "has no CUDA device: here Lightning's Trainer would apply it on the CPU, where it was never measured"]


def test_an_export_the_cpu_cannot_apply_says_so(tmp_path, no_cuda):
    result = CliRunner().invoke(app, ["export", str(_config(tmp_path, 'mode = "fp16-mixed"\n')), "--to", "transformers"])
    assert result.exit_code == 0, result.output
    assert "this machine has no CUDA device: here on the CPU the Hugging Face Trainer cannot apply it" in result.stderr


def test_an_export_on_a_cuda_machine_adds_nothing(tmp_path, two_gpus):
    result = CliRunner().invoke(app, ["export", str(_config(tmp_path)), "--to", "lightning"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
