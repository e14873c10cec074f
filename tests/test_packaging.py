"""The wheel holds what an installed package needs at run time (the pilot models)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_pilot_models(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("ort_offload-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in sorted(p.name for p in (ROOT / "pilot").glob("*.onnx")):
        assert f"pilot/{model}" in names
