"""The package layering of pyproject.toml's import-linter contracts holds."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    if lint is None:
        pytest.fail("lint-imports (import-linter) is missing: it is in the test extra, run `make setup`")
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

