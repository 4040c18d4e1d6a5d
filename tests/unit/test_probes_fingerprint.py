"""hardware_fingerprint: stable, sensitive to what changes the answer, blind to the rest."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from probes import HardwareProfile, hardware_fingerprint
from probes._fingerprint import FINGERPRINT_VERSION, major_minor

GIB = 1024**3

A100 = HardwareProfile(
    kind="cuda",
    name="NVIDIA A100-SXM4-80GB",
    index=0,
    compute_capability=(8, 0),
    sm_count=108,
    memory_total=81229 * 1024**2,
    memory_free=80000 * 1024**2,
    driver_version="550.54.15",
    cuda_runtime="12.4",
    mig_enabled=False,
    clocks_mhz=(210, 1410),
    torch_version="2.5.1+cu124",
    libraries=(("torchao", "0.10.0"), ("transformer_engine", "2.1.0")),
    uuid="GPU-00000004-1d2c-4b6e-9f3a-000000000004",
)
CPU = HardwareProfile(
    kind="cpu",
    name="Intel(R) Xeon(R) Platinum 8480+",
    memory_total=256 * GIB,
    memory_free=200 * GIB,
    cores=56,
    cpu_flags=("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512_fp16", "avx512f"),
    torch_version="2.5.1",
    libraries=(("torchao", "0.10.0"), ("transformer_engine", None)),
)


def test_format_and_stability():
    digest = hardware_fingerprint(A100)
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert hardware_fingerprint(HardwareProfile.from_dict(A100.to_dict())) == digest


def test_pinned_values_catch_recipe_changes():
    # If these change, every cached result misses: bump FINGERPRINT_VERSION on purpose, and add
    # a cache migration that rekeys stored entries (advisor/cache/_migrations.py).
    assert FINGERPRINT_VERSION == 2
    assert hardware_fingerprint(A100) == "243e1c5ca25fa53d"
    assert hardware_fingerprint(CPU) == "c75a31ae5ef623c1"
    # Recipe 1 stays computable, to recognise policies recorded under it.
    assert hardware_fingerprint(A100, version=1) == "e616086b263e1164"
    assert hardware_fingerprint(CPU, version=1) == "c03235b73c15bbe3"


def test_an_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="recipe 3 is unknown"):
        hardware_fingerprint(A100, version=3)


@pytest.mark.parametrize(
    "change",
    [
        {"name": "NVIDIA A100-SXM4-40GB"},
        {"compute_capability": (8, 6)},
        {"memory_total": A100.memory_total + 2 * GIB},
        {"sm_count": 98},
        {"cuda_runtime": "12.6"},
        {"cuda_runtime": None},
        {"torch_version": "2.6.0+cu126"},
        {"torch_version": "2.6.0a0+git1234"},
        {"kind": "cpu"},
    ],
    ids=lambda change: f"{next(iter(change))}={next(iter(change.values()))}",
)
def test_changes_with_each_fact_that_changes_the_answer(change):
    assert hardware_fingerprint(replace(A100, **change)) != hardware_fingerprint(A100)


@pytest.mark.parametrize(
    "change",
    [
        {"driver_version": "560.35.03"},
        {"driver_version": None},
        {"torch_version": "2.5.2+cu124"},
        {"torch_version": "2.5.1"},  # the CUDA build tag: cuda_runtime says which CUDA
        {"cuda_runtime": "12.4.1"},
        # FP8 libraries matter to FP8 answers only: policies.hardware_mismatch checks them.
        {"libraries": (("torchao", "0.11.0"), ("transformer_engine", "2.1.0"))},
        {"libraries": (("torchao", "0.10.0"), ("transformer_engine", None))},
    ],
    ids=lambda change: f"{next(iter(change))}={next(iter(change.values()))}",
)
def test_routine_upgrades_keep_the_fingerprint(change):
    assert hardware_fingerprint(replace(A100, **change)) == hardware_fingerprint(A100)
    # Recipe 1 threw every cached answer away on any of these.
    assert hardware_fingerprint(replace(A100, **change), version=1) != hardware_fingerprint(A100, version=1)


@pytest.mark.parametrize(
    ("version", "line"),
    [("2.5.1+cu124", "2.5"), ("2.6.0a0+git1234", "2.6"), ("12.4", "12.4"), ("12", "12"), (None, None)],
)
def test_major_minor(version, line):
    assert major_minor(version) == line


@pytest.mark.parametrize(
    "change",
    [
        {"uuid": "GPU-ffffffff-0000-0000-0000-000000000000"},
        {"index": 3},
        {"memory_free": 1 * GIB},
        {"clocks_mhz": (1410, 1410)},
        {"mig_enabled": None},
        {"memory_total": A100.memory_total + 100 * 1024**2},  # same SKU, a few MiB apart
    ],
    ids=lambda change: next(iter(change)),
)
def test_ignores_what_differs_between_identical_cards(change):
    assert hardware_fingerprint(replace(A100, **change)) == hardware_fingerprint(A100)


@pytest.mark.parametrize(
    "change",
    [
        {"cpu_flags": ("avx2", "avx512f")},
        {"cores": 8},
        {"name": "AMD EPYC 9654 96-Core Processor"},
        {"memory_total": 64 * GIB},
        {"torch_version": "2.6.0"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_cpu_changes_with_flags_cores_and_versions(change):
    assert hardware_fingerprint(replace(CPU, **change)) != hardware_fingerprint(CPU)


def test_cpu_ignores_free_memory():
    assert hardware_fingerprint(replace(CPU, memory_free=1 * GIB)) == hardware_fingerprint(CPU)


def test_library_order_does_not_matter():
    swapped = replace(CPU, libraries=tuple(reversed(CPU.libraries)))
    assert hardware_fingerprint(swapped) == hardware_fingerprint(CPU)
