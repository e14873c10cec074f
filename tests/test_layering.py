"""The package layering of pyproject.toml's import-linter contracts holds, and no function of
the project is longer than a screen."""

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



PACKAGES = ("ort_offload", "graph_passes", "custom_ops", "pilot", "models", "benchmarks")
MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_screen():
    import ast

    long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over {} lines:\n{}".format(MAX_FUNCTION_LINES, "\n".join(long))
