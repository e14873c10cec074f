"""Shared fixtures: one export cache per test session, so each tiny model is exported once, and
one fixed CPU profile, so plans do not follow the machine's load."""

from __future__ import annotations

import json
import os
import pathlib
import sys

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


@pytest.fixture(scope="session", autouse=True)
def export_cache_dir(tmp_path_factory):
    """Point ort_offload's export cache at a session directory (and restore the env after);
    the profile cache beside it holds the reference CPU profile."""
    from graph_passes.cost.device_profiles import cpu_model_name

    path = tmp_path_factory.mktemp("export_cache")
    profiles = path.parent / "profiles"
    profiles.mkdir(exist_ok=True)
    (profiles / "cpu.json").write_text(json.dumps({cpu_model_name(): REFERENCE_CPU_PROFILE}), encoding="utf-8")
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
