"""Device profiles: the few numbers the cost model and the simulator need about a device.

A :class:`DeviceProfile` holds peak compute (FLOP/s), device-memory bandwidth (bytes/s), the
host↔device link bandwidth per direction and with both directions busy at once (bytes/s, the
total over both directions), device memory size and a per-kernel launch overhead.

Shipped profiles are **nominal**: vendor datasheet peaks (dense fp32 without tensor cores) and,
for the host link, the practical PCIe rate rather than the raw signalling rate. Only the V100
link numbers are measured (SwapAdvisor §6.1 on an EC2 p3.2xlarge: "12GB/s unidirectional and
20GB/s bidirectional"). Peaks are what a roofline needs to rank plans; absolute step times on
those profiles are estimates. The ``H200`` profile is measured on a lent machine
(``benchmarks/gpu_check.py``). The ``cpu`` profile is measured on this machine by
:func:`measure_cpu_profile` (on the CPU device a swap is a memcpy between the arena and the host
store, so the "link" is memcpy bandwidth) and cached as JSON, keyed by the CPU model name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from graph_passes.cache_files import write_json_replacing

logger = logging.getLogger(__name__)

GB = 10**9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device. Bandwidths in bytes/s, compute in FLOP/s.

    ``duplex_bandwidth`` is the link's total rate while both directions copy at once (each
    direction then gets half of it, at most its one-way rate).
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    h2d_bandwidth: float
    d2h_bandwidth: float
    duplex_bandwidth: float
    device_memory_bytes: int
    kernel_launch_s: float
    # Fixed cost of running one execution block (binding its tensors, one session call) on top
    # of its kernels: what makes many small blocks slower than a few large ones.
    block_overhead_s: float = 0.0
    # Whether copies run beside compute (a GPU's copy engines) or take the same cores and
    # memory bus (the CPU device, where a swap is a memcpy): then no copy hides under compute.
    copies_overlap_compute: bool = True

    def __post_init__(self) -> None:
        for field in ("peak_flops", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "duplex_bandwidth"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"device profile {self.name!r}: {field} must be a positive finite number, got {value!r}")
        for field in ("kernel_launch_s", "block_overhead_s"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"device profile {self.name!r}: {field} must be >= 0, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


# Typical CUDA kernel launch overhead seen from the host (a few µs); nominal.
_GPU_KERNEL_LAUNCH_S = 5e-6
# Per-block cost on a GPU: none on the device's timeline. Blocks are enqueued on a CUDA stream
# without a host synchronisation between them, so the host binds and launches block i+1 while
# the device runs block i (the per-kernel launch cost above is still charged). Nominal.
_GPU_BLOCK_OVERHEAD_S = 0.0

# NVIDIA V100 (SXM2 16 GB, as in EC2 p3.2xlarge, SwapAdvisor's machine), nominal datasheet values:
# fp32 15.7 TFLOP/s, HBM2 900 GB/s, 16 GB. Host link PCIe 3.0 x16 as *measured* by SwapAdvisor
# (§6.1): 12 GB/s one way, 20 GB/s with both directions busy.
V100_16GB_PCIE3 = DeviceProfile(
    name="V100-16GB-PCIe3",
    peak_flops=15.7e12,
    memory_bandwidth=900 * GB,
    h2d_bandwidth=12 * GB,
    d2h_bandwidth=12 * GB,
    duplex_bandwidth=20 * GB,
    device_memory_bytes=16 * GiB,
    kernel_launch_s=_GPU_KERNEL_LAUNCH_S,
    block_overhead_s=_GPU_BLOCK_OVERHEAD_S,
)

# NVIDIA A100 80 GB SXM4, nominal datasheet values (A100 datasheet, "A100 80GB SXM"): fp32
# 19.5 TFLOP/s, HBM2e 2,039 GB/s, 80 GB. Host link PCIe 4.0 x16: 32 GB/s raw per direction
# (datasheet "PCIe Gen4: 64GB/s" for both together); ~25 GB/s is the practical one-way rate of
# pinned copies. Duplex: no vendor figure; scaled by SwapAdvisor's measured duplex/one-way ratio
# (20/12) to 40 GB/s. Estimate.
A100_80GB = DeviceProfile(
    name="A100-80GB",
    peak_flops=19.5e12,
    memory_bandwidth=2039 * GB,
    h2d_bandwidth=25 * GB,
    d2h_bandwidth=25 * GB,
    duplex_bandwidth=40 * GB,
    device_memory_bytes=80 * GiB,
    kernel_launch_s=_GPU_KERNEL_LAUNCH_S,
    block_overhead_s=_GPU_BLOCK_OVERHEAD_S,
)

# NVIDIA H100 SXM5 80 GB, nominal datasheet values (H100 datasheet, "H100 SXM"): fp32
# 67 TFLOP/s (H100 PCIe: 51), HBM3 3.35 TB/s, 80 GB. Host link PCIe 5.0 x16: 64 GB/s raw per
# direction (datasheet "PCIe Gen5: 128GB/s" for both together); ~50 GB/s practical one way.
# Duplex: scaled by SwapAdvisor's 20/12 ratio to 80 GB/s. Estimate.
H100 = DeviceProfile(
    name="H100",
    peak_flops=67e12,
    memory_bandwidth=3350 * GB,
    h2d_bandwidth=50 * GB,
    d2h_bandwidth=50 * GB,
    duplex_bandwidth=80 * GB,
    device_memory_bytes=80 * GiB,
    kernel_launch_s=_GPU_KERNEL_LAUNCH_S,
    block_overhead_s=_GPU_BLOCK_OVERHEAD_S,
)

# NVIDIA H200 (141 GB), *measured* on a lent machine on 2026-11-26 by
# `python3 benchmarks/gpu_check.py device` (torch 2.11+cu130; results in
# benchmarks/results/2026-11-26/gpu_check_run1.json): fp32 matmul 8192³ with TF32 off 50.9 TFLOP/s,
# device-to-device copy 4,164 GB/s (read + write), pinned 1 GiB copies 54.5 GB/s host→device,
# 55.3 GB/s device→host, 99.1 GB/s total with both directions at once; matmuls with copies
# running both ways took 1.003× their time alone. The launch cost stays nominal: the 10 µs
# measured per tiny op is torch's host-side dispatch, not the gap between kernels on the device.
H200 = DeviceProfile(
    name="H200",
    peak_flops=50.9e12,
    memory_bandwidth=4164 * GB,
    h2d_bandwidth=54.5 * GB,
    d2h_bandwidth=55.3 * GB,
    duplex_bandwidth=99.1 * GB,
    device_memory_bytes=143771 * 2**20,
    kernel_launch_s=_GPU_KERNEL_LAUNCH_S,
    block_overhead_s=_GPU_BLOCK_OVERHEAD_S,
)

SHIPPED_PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (V100_16GB_PCIE3, A100_80GB, H100, H200)}

CPU_PROFILE_NAME = "cpu"

# Per-node dispatch overhead of ONNX Runtime's CPU EP inside one session (about a µs); nominal.
CPU_KERNEL_LAUNCH_S = 1e-6
# Per-block cost on the CPU device, from `python -m benchmarks.overhead` on this 2-core machine
# (gpt small): 6 blocks of 1024 nodes 182 ms, 13 of 256 196 ms, 41 of 64 204 ms per step, about
# 0.6 ms per extra block once the graph is cut (one session call, and the cross-node
# parallelism and fusion ONNX Runtime loses at each cut). Planning heuristic, not measured per run.
CPU_BLOCK_OVERHEAD_S = 0.6e-3

_CACHE_ENV = "ORT_OFFLOAD_CACHE_DIR"  # the export cache; profiles live next to it


def profile_cache_dir() -> Path:
    """Where measured profiles are cached: ``$ORT_OFFLOAD_CACHE_DIR/../profiles`` when that is
    set, otherwise ``~/.cache/ort_offload/profiles`` (honouring ``XDG_CACHE_HOME``)."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).parent / "profiles"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ort_offload" / "profiles"


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), with the core count: the cache key."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown-cpu"
    return f"{name} ({os.cpu_count() or 1} cores)"


def _best_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm up: page faults, thread pool start
    best = math.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _measure_matmul_flops(n: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    return 2.0 * n**3 / _best_time(lambda: np.matmul(a, b, out=out), repeats)


def _measure_copy_seconds(nbytes: int, repeats: int) -> float:
    src = np.ones(max(1, nbytes // 4), dtype=np.float32)
    dst = np.empty_like(src)
    return _best_time(lambda: np.copyto(dst, src), repeats)


def _measure_duplex_bandwidth(nbytes: int, repeats: int) -> float:
    """Total rate of two memcpys at once (one per direction), each in its own thread."""
    buffers = [(np.ones(max(1, nbytes // 4), dtype=np.float32), np.empty(max(1, nbytes // 4), dtype=np.float32))
               for _ in range(2)]

    def both() -> None:
        threads = [threading.Thread(target=np.copyto, args=(dst, src)) for src, dst in buffers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return 2 * buffers[0][0].nbytes / _best_time(both, repeats)


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def measure_cpu_profile(
    *,
    matmul_n: int = 1024,
    copy_bytes: int = 64 * 2**20,
    repeats: int = 5,
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
) -> DeviceProfile:
    """Measure this CPU (or read the cached measurement of this CPU model).

    Peak FLOP/s: best of ``repeats`` float32 matmuls of ``matmul_n``³ (2n³ FLOPs). Memory
    bandwidth: best copy of a ``copy_bytes`` array, counting read plus write. Link (h2d, d2h):
    the same copy, counting the bytes moved (a swap on the CPU device is one memcpy). Duplex:
    two such copies in two threads at once. ``refresh`` re-measures and overwrites the cache.
    """
    directory = Path(cache_dir) if cache_dir is not None else profile_cache_dir()
    path = directory / "cpu.json"
    key = cpu_model_name()
    cached: dict = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(cached, dict):
                cached = {}
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable profile cache %s (%s)", path, e)
            cached = {}
    if not refresh and key in cached:
        try:
            # The per-block cost and copy overlap are constants, not measured: a cache from
            # before they existed (or with other values) gets the current ones.
            return DeviceProfile.from_dict(
                {**cached[key], "block_overhead_s": CPU_BLOCK_OVERHEAD_S, "copies_overlap_compute": False}
            )
        except (TypeError, ValueError) as e:
            logger.warning("ignoring bad cached profile for %r in %s (%s)", key, path, e)

    flops = _measure_matmul_flops(matmul_n, repeats)
    copy_s = _measure_copy_seconds(copy_bytes, repeats)
    moved = max(4, copy_bytes // 4 * 4)
    link = moved / copy_s
    profile = DeviceProfile(
        name=CPU_PROFILE_NAME,
        peak_flops=flops,
        memory_bandwidth=2 * moved / copy_s,
        h2d_bandwidth=link,
        d2h_bandwidth=link,
        duplex_bandwidth=_measure_duplex_bandwidth(copy_bytes, repeats),
        device_memory_bytes=_physical_memory_bytes(),
        kernel_launch_s=CPU_KERNEL_LAUNCH_S,
        block_overhead_s=CPU_BLOCK_OVERHEAD_S,
        copies_overlap_compute=False,
    )
    logger.info("measured cpu profile for %s: %.1f GFLOP/s, %.1f GB/s memory, %.1f GB/s memcpy",
                key, flops / 1e9, profile.memory_bandwidth / 1e9, link / 1e9)
    cached[key] = profile.to_dict()
    try:
        write_json_replacing(path, cached, indent=2)
    except OSError as e:  # a read-only cache costs a re-measurement, nothing else
        logger.warning("cannot cache the cpu profile in %s (%s)", path, e)
    return profile


def profile_names() -> list[str]:
    return [CPU_PROFILE_NAME, *SHIPPED_PROFILES]


def get_profile(name: str, **measure_options) -> DeviceProfile:
    """A shipped profile by name, or ``"cpu"``: this machine, measured once and cached.

    ``measure_options`` go to :func:`measure_cpu_profile`. Unknown names raise ``ValueError``.
    """
    if name in SHIPPED_PROFILES:
        return SHIPPED_PROFILES[name]
    if name == CPU_PROFILE_NAME:
        return measure_cpu_profile(**measure_options)
    raise ValueError(f"unknown device profile {name!r}: valid names are {', '.join(profile_names())}")


__all__ = [
    "A100_80GB", "CPU_PROFILE_NAME", "DeviceProfile", "H100", "H200", "SHIPPED_PROFILES", "V100_16GB_PCIE3",
    "cpu_model_name", "get_profile", "measure_cpu_profile", "profile_cache_dir", "profile_names",
]
