"""fp8_library_versions reads package metadata and never imports the libraries."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from probes import fp8_library_versions


def _installed(**versions: str):
    def version(distribution: str) -> str:
        if distribution in versions:
            return versions[distribution]
        raise metadata.PackageNotFoundError(distribution)

    return version


def test_matches_installed_metadata():
    try:
        torchao = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        torchao = None
    assert dict(fp8_library_versions())["torchao"] == torchao


def test_does_not_import_the_libraries():
    before = {"torchao", "transformer_engine"} & set(sys.modules)
    fp8_library_versions()
    assert {"torchao", "transformer_engine"} & set(sys.modules) == before


@pytest.mark.parametrize(
    "distribution", ["transformer-engine", "transformer_engine", "transformer-engine-torch"]
)
def test_each_transformer_engine_distribution_name(monkeypatch, distribution):
    monkeypatch.setattr(metadata, "version", _installed(**{distribution: "2.1.0"}))
    assert fp8_library_versions() == (("torchao", None), ("transformer_engine", "2.1.0"))


def test_meta_package_version_wins_over_the_extension(monkeypatch):
    monkeypatch.setattr(
        metadata,
        "version",
        _installed(**{"transformer-engine": "2.2.0", "transformer-engine-torch": "2.1.0"}),
    )
    assert dict(fp8_library_versions())["transformer_engine"] == "2.2.0"


def test_nothing_installed(monkeypatch):
    monkeypatch.setattr(metadata, "version", _installed())
    assert fp8_library_versions() == (("torchao", None), ("transformer_engine", None))


def test_unreadable_metadata_counts_as_absent(monkeypatch):
    def broken(distribution: str) -> str:
        raise OSError("metadata unreadable")

    monkeypatch.setattr(metadata, "version", broken)
    assert fp8_library_versions() == (("torchao", None), ("transformer_engine", None))
