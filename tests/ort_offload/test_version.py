"""``ort_offload.__version__``: the installed distribution's version, else the source tree's."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import ort_offload
from ort_offload import version as version_module
from ort_offload.version import UNKNOWN_VERSION, package_version, source_tree_version

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_projects():
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ort_offload.__version__ == expected == importlib.metadata.version("ort-offload")


def test_without_installed_metadata_the_source_tree_names_the_version(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version_module, "version", not_installed)
    assert package_version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_a_pyproject_of_another_project_or_none_gives_unknown(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    assert source_tree_version(pyproject) == UNKNOWN_VERSION
    pyproject.write_text('[project]\nname = "something-else"\nversion = "2.0"\n')
    assert source_tree_version(pyproject) == UNKNOWN_VERSION
    pyproject.write_text("[project\n")
    assert source_tree_version(pyproject) == UNKNOWN_VERSION
    pyproject.write_text('[project]\nname = "ort-offload"\nversion = "9.8.7"\n')
    assert source_tree_version(pyproject) == "9.8.7"
