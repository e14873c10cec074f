"""The package's version: from the installed distribution's metadata, else from the source tree.

An installed package (wheel or editable) knows its version from ``importlib.metadata``; a checkout
run without installing reads ``pyproject.toml`` beside the package. Standard library only, at the
bottom of the package, so ``import ort_offload`` stays light.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "ort-offload"
UNKNOWN_VERSION = "0+unknown"


def package_version() -> str:
    """The version of the ``ort-offload`` distribution this code belongs to."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return source_tree_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def source_tree_version(pyproject: Path) -> str:
    """``project.version`` of ``pyproject`` when it describes ``ort-offload``, else ``0+unknown``."""
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return UNKNOWN_VERSION
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return UNKNOWN_VERSION
    return project["version"]
