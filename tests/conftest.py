"""Shared fixtures: an export cache kept between runs (per exporter and model code), so each
tiny model is exported once, and one fixed CPU profile, so plans do not follow the machine's load."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import pytest

# Test helpers (helpers.py, split_helpers.py, pilot_helpers.py) import by name from any subfolder.
sys.path.append(str(pathlib.Path(__file__).resolve().parent))

# A reference profile of a 2-core CPU of this kind. Measured per session instead, the matmul
# rate swung 36-157 GFLOP/s with the machine's load, and the planners' choices (recompute or
# swap, block sizes, Mimose's buckets) with it; the profile's own measurement is tested on its own.
REFERENCE_CPU_PROFILE = {
    "name": "cpu",
    "peak_flops": 100e9,
    "memory_bandwidth": 13e9,
    "h2d_bandwidth": 6.5e9,
    "d2h_bandwidth": 6.5e9,
    "duplex_bandwidth": 9e9,
    "device_memory_bytes": 24 * 2**30,
    "kernel_launch_s": 1e-6,
    "block_overhead_s": 6e-4,
    "copies_overlap_compute": False,
}


ROOT = pathlib.Path(__file__).resolve().parents[1]
# The code an exported graph depends on beyond what the export cache's key holds (the captured
# program, the optimizer, the versions of torch/onnx/onnxscript/onnx_ir and of the exporter's
# own modules): block exports, the zoo models, the training graph's roles.
EXPORT_SOURCES = ("ort_offload/export", "ort_offload/dynamic", "models", "graph_passes/ir")
KEPT_EXPORTS = ROOT / ".test-cache"


def pytest_addoption(parser):
    parser.addoption("--fresh-exports", action="store_true",
                     help="export every model afresh (a session directory) instead of reusing the exports "
                          "kept in .test-cache/ from earlier runs of the same exporter and model code")


def _export_sources_digest() -> str:
    digest = hashlib.sha256()
    for folder in EXPORT_SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _kept_exports_dir() -> pathlib.Path:
    """``.test-cache/exports-<digest of EXPORT_SOURCES>``: a change to that code starts an empty
    directory (the ones of other digests, untouched for an hour, are removed)."""
    path = KEPT_EXPORTS / f"exports-{_export_sources_digest()}"
    path.mkdir(parents=True, exist_ok=True)
    for other in KEPT_EXPORTS.glob("exports-*"):
        if other != path and time.time() - other.stat().st_mtime > 3600:
            shutil.rmtree(other, ignore_errors=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def export_cache_dir(tmp_path_factory, pytestconfig):
    """Point ort_offload's export cache at the exports kept between runs (a session directory
    with ``--fresh-exports``), and restore the env after; a session directory holds the
    reference CPU profile (the profile cache is read beside the export cache).

    Each tiny model is exported once per exporter and model code, not once per run: entries are
    verified against their content hashes, and their keys hold everything else the graph depends
    on. The tests of the exporter and of the cache itself export into directories of their own."""
    from graph_passes.cost.device_profiles import cpu_model_name

    session = tmp_path_factory.mktemp("export_cache")
    path = session if pytestconfig.getoption("fresh_exports") else _kept_exports_dir()
    profiles = path.parent / "profiles"
    profiles.mkdir(exist_ok=True)
    written = profiles / f"cpu.json.{os.getpid()}"  # then renamed: another session may be reading it
    written.write_text(json.dumps({cpu_model_name(): REFERENCE_CPU_PROFILE}), encoding="utf-8")
    os.replace(written, profiles / "cpu.json")
    old = os.environ.get("ORT_OFFLOAD_CACHE_DIR")
    os.environ["ORT_OFFLOAD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ORT_OFFLOAD_CACHE_DIR", None)
    else:
        os.environ["ORT_OFFLOAD_CACHE_DIR"] = old


_BENCHMARK_TESTS = pathlib.Path(__file__).resolve().parent / "benchmarks"


def pytest_collection_modifyitems(config, items):
    """Tests under tests/benchmarks run the benchmark scripts: marked ``bench`` (``make test``
    leaves them to ``make test-all``)."""
    for item in items:
        if _BENCHMARK_TESTS in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.bench)
