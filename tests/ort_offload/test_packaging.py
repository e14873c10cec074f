"""The wheel holds what an installed package needs at run time (the pilot models)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _clean_copy(target: Path) -> Path:
    """The project's files as a fresh clone has them (no build or egg-info leftovers)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def test_the_wheel_ships_the_pilot_models(tmp_path):
    source = _clean_copy(tmp_path / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("ort_offload-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in sorted(p.name for p in (ROOT / "pilot").glob("*.onnx")):
        assert f"pilot/{model}" in names
