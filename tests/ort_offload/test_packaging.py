"""The wheel holds what an installed package needs at run time (the pilot models), and a fresh
venv with only the wheel installed trains a static and a dynamic zoo model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

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


def _build_wheel(tmp_path: Path) -> Path:
    source = _clean_copy(tmp_path / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, cwd=tmp_path,
    )
    return next(tmp_path.glob("ort_offload-*.whl"))


def test_the_wheel_ships_the_pilot_models_and_the_license(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in sorted(p.name for p in (ROOT / "pilot").glob("*.onnx")):
        assert f"pilot/{model}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def _fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv holding only the wheel; its dependencies (torch, onnxruntime, ...) come from this
    interpreter's site-packages through a path file, added after the install so that pip sees an
    empty environment, and without running that directory's own path files (this project's
    editable install among them)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, cwd=tmp_path)
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(own) / "ort_offload_test_deps.pth").write_text("".join(f"{path}\n" for path in ours))
    return venv


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_trains_a_static_and_a_dynamic_model(tmp_path):
    """Run from a directory outside the source tree, so that only the installed package can be
    imported; the dynamic model prefetches with the pilot, which must come from the wheel."""
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["ORT_OFFLOAD_CACHE_DIR"] = str(tmp_path / "cache")

    def run(*command):
        return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)

    where = run(str(venv / "bin" / "python"), "-c",
                "import ort_offload, pilot, graph_passes; print(ort_offload.__file__, pilot.__file__, "
                "graph_passes.__file__, ort_offload.__version__)")
    assert where.returncode == 0, where.stderr
    *files, version = where.stdout.split()
    assert all(Path(f).is_relative_to(venv) for f in files), files
    assert run(str(venv / "bin" / "ort-offload"), "--version").stdout == f"ort-offload {version}\n"
    for model, options in (("gpt", ("--budget", "0.9x")), ("var-lstm", ("--budget", "0.5x", "--predictor", "pilot"))):
        report_path = work / f"{model}.json"
        result = run(str(venv / "bin" / "ort-offload"), "train", "--model", model, "--config", "tiny", "--steps", "2",
                     "--quiet", "--json", str(report_path), *options)
        assert result.returncode == 0, f"{model}: {result.stderr[-2000:]}"
        report = json.loads(report_path.read_text())
        assert report["steps"] == 2 and report["within_budget"] is True, model
    assert report["pilot_inference_us_median"] is not None  # var-lstm's paths were predicted by the pilot
