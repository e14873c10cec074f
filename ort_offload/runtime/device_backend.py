"""Device backends: the seam where a device plugs into the runtime.

A :class:`DeviceBackend` bundles what differs between devices: the memory the arena lives in,
the host memory swapped tensors go to, the two copy engines (host→device, device→host), the
stream blocks compute on, and the ONNX Runtime providers and run options of block sessions.

- CPU: host RAM, copy threads (:class:`~ort_offload.runtime.copy_engine.CopyEngine`), ORT's CPU EP.
- CUDA (:func:`cuda_backend`): one GPU allocation through torch, pinned host memory, CUDA
  streams with events (:mod:`ort_offload.runtime.streams`), ORT's CUDA EP on our compute stream. torch
  is the CUDA binding because it is already our dependency and gives all four pieces (device
  allocation, pinned memory, streams, events) with a caching host allocator that keeps a
  pinned staging buffer alive until the stream using it has passed it.

CUDA code is imported only when a CUDA device is asked for; :func:`stream_backend` runs the
CUDA path (torch memory, stream engines) on the CPU so CI tests it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any

import onnxruntime as ort

from ort_offload.runtime.copy_engine import CopyEngine
from ort_offload.runtime.device_counter import PeakSampler
from ort_offload.runtime.device_memory import DeviceMemory, NumpyMemory, TorchMemory
from ort_offload.errors import UnknownDeviceError
from graph_passes.formatting import format_bytes
from ort_offload.runtime.streams import ImmediateStreams, StreamCopyEngine, Streams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DeviceBackend:
    """Memory, copy engines, compute stream and ORT providers of one device."""

    memory: DeviceMemory
    h2d: Any  # CopyEngine or StreamCopyEngine
    d2h: Any
    providers: list
    streams: Streams | None = None  # None: no device streams (the CPU device)
    overhead_bytes: int = 0  # device memory taken before anything of ours (CUDA context, handles)
    used_bytes: Any = None  # () -> device bytes the process uses now, less overhead; None: not measurable
    counter: PeakSampler | None = None  # samples used_bytes while a step runs (CUDA)
    session_bytes: int = 0  # device memory each block session holds for its own (library handles, CUDA)
    # Whether ORT's scatter-add kernels here add colliding updates in a varying order (CUDA's
    # atomics): the graph's scatter-adds are then planned and run as one-hot products.
    scatters_race: bool = False
    run_options: ort.RunOptions | None = None
    profile_name: str = "cpu"  # the device profile (graph_passes.cost.device_profiles) plans are timed on
    # Planned swap-ins of at most this many bytes copy when issued, on the thread that runs the
    # blocks, rather than on the host→device engine (0: every one on the engine).
    inline_copy_bytes: int = 0

    @property
    def memory_is_host(self) -> bool:
        """Whether the arena is host memory (numpy views, no folding of host-slot inputs)."""
        return getattr(self.memory, "is_host", False)

    def on_compute_stream(self):
        """Context in which torch issues its copies on the stream blocks run on."""
        if self.streams is None:
            return contextlib.nullcontext()
        return self.streams.using(self.streams.compute)

    def synchronize(self) -> None:
        if self.streams is not None:
            self.streams.synchronize()


# On the CPU device a small swap-in copies faster than a copy thread takes it over (RAM to RAM;
# docs/decisions.md has the measurement).
CPU_INLINE_COPY_BYTES = 64 * 1024


def cpu_backend() -> DeviceBackend:
    return DeviceBackend(NumpyMemory(), CopyEngine("h2d"), CopyEngine("d2h"), ["CPUExecutionProvider"],
                         inline_copy_bytes=CPU_INLINE_COPY_BYTES)


def stream_backend(memory: DeviceMemory | None = None, streams: Streams | None = None) -> DeviceBackend:
    """The CUDA device's runtime path with any memory and streams: on the CPU, torch CPU
    memory and :class:`ImmediateStreams` (what CI runs of the CUDA path)."""
    memory = memory if memory is not None else TorchMemory("cpu")
    streams = streams if streams is not None else ImmediateStreams()
    return DeviceBackend(
        memory, StreamCopyEngine("h2d", streams), StreamCopyEngine("d2h", streams), ["CPUExecutionProvider"],
        streams=streams,
    )


def parse_cuda_kind(kind: str, device_id: int | None) -> int:
    """The device index of ``"cuda"`` / ``"cuda:N"`` (``device_id`` when given)."""
    name = kind.strip().lower()
    index = 0
    if name.startswith("cuda:"):
        text = name.split(":", 1)[1]
        if not text.isdigit():
            raise UnknownDeviceError(f"unknown device {kind!r}: use 'cuda' or 'cuda:N' with N a GPU index")
        index = int(text)
    elif name != "cuda":
        raise UnknownDeviceError(f"unknown device {kind!r}: use 'cuda' or 'cuda:N'")
    if device_id is not None:
        if name.startswith("cuda:") and device_id != index:
            raise UnknownDeviceError(f"device {kind!r} and device_id={device_id} disagree: give one of them")
        index = device_id
    return index


def check_cuda(device_id: int) -> None:
    """One clear error unless onnxruntime-gpu with CUDA and a GPU ``device_id`` are here."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise UnknownDeviceError(
            "the CUDA device needs onnxruntime-gpu (CUDA 13 build), which this environment lacks: "
            "run `make setup-gpu` and use .venv-gpu, or use device 'cpu'"
        )
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise UnknownDeviceError("the CUDA device needs torch with CUDA") from e
    if not torch.cuda.is_available():
        raise UnknownDeviceError("no CUDA GPU is visible to torch (a CPU-only torch build or no GPU): use device 'cpu'")
    if not 0 <= device_id < torch.cuda.device_count():
        raise UnknownDeviceError(f"no GPU {device_id}: this machine has {torch.cuda.device_count()}")


def cuda_provider_options(device_id: int, stream_pointer: int | None) -> dict[str, str]:
    """CUDA EP options for block sessions: our compute stream, no TF32 (fp32 numbers equal to
    torch with TF32 off), arena growth by what is asked, no large cuDNN trial workspaces."""
    options = {
        "device_id": str(device_id),
        "arena_extend_strategy": "kSameAsRequested",
        # ORT_OFFLOAD_CUDNN_CONV_ALGO_SEARCH=DEFAULT (a diagnostic): cuDNN's fixed algorithm
        # (the conv blocks of cnn medium took 5.4 GB beyond their plan under HEURISTIC).
        "cudnn_conv_algo_search": os.environ.get("ORT_OFFLOAD_CUDNN_CONV_ALGO_SEARCH", "HEURISTIC"),
        "cudnn_conv_use_max_workspace": "0",
        "use_tf32": "0",
        "do_copy_in_default_stream": "0",
    }
    if stream_pointer is not None:
        options["user_compute_stream"] = str(stream_pointer)
    return options


def _share_cuda_arena(device_id: int, options: dict[str, str]) -> bool:
    """One ORT CUDA arena for every block session (the environment allocator), so the device
    memory ORT holds for block-internal values is the largest block's, not a sum over sessions."""
    try:
        info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_id, ort.OrtMemType.DEFAULT)
        # max_mem 0 (no cap), kSameAsRequested (1), ORT's defaults for chunk sizes.
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, options, ort.OrtArenaCfg(0, 1, -1, -1))
    except Exception as e:
        logger.warning("no shared ORT CUDA arena (%s): each block session keeps its own", str(e).splitlines()[0])
        return False
    return True


def _warm_up(providers: list):
    """A session that ran one tiny MatMul on the CUDA EP (so the context, the libraries and
    the session's own handles exist before memory is measured)."""
    import numpy as np
    import onnx

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 8])
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "x"], ["y"])], "warm_up", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=providers)
    session.run(None, {"x": np.ones((8, 8), np.float32)})
    return session


@dataclasses.dataclass(frozen=True)
class _CudaEnvironment:
    """What every CUDA device on one GPU shares in a process: the compute stream, the block
    sessions' providers, and the memory taken before any tensor of ours (measured once, before
    the shared ORT arena holds anything)."""

    streams: Any
    providers: list
    overhead_bytes: int
    session_bytes: int
    profile_name: str
    shared_arena: bool  # one ORT CUDA arena for every block session (see _share_cuda_arena)


@functools.cache
def _cuda_environment(device_id: int) -> _CudaEnvironment:
    import torch

    from ort_offload.runtime.streams import TorchCudaStreams

    # Every ORT CUDA session keeps cuBLAS handles with their own workspace (about 33 MB each
    # by cuBLAS's default on this GPU generation, 9 MB with 16 KiB x 8); with one session per
    # block that is memory the budget must pay for. The small setting is also one of the two
    # that make cuBLAS deterministic across streams.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    torch.cuda.init()
    streams = TorchCudaStreams(device_id)
    options = cuda_provider_options(device_id, streams.pointer(streams.compute))
    providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    shared = os.environ.get("ORT_OFFLOAD_SHARED_CUDA_ARENA") != "0" and _share_cuda_arena(
        device_id, {k: v for k, v in options.items() if k != "user_compute_stream"})
    first = _warm_up(providers)
    torch.cuda.synchronize(device_id)
    with_one = _process_device_bytes(device_id)
    second = _warm_up(providers)  # a second session: what each more session holds
    torch.cuda.synchronize(device_id)
    session_bytes = max(_process_device_bytes(device_id) - with_one, 0)
    del first, second
    torch.cuda.synchronize(device_id)
    logger.info("CUDA device %d: %s before any tensor, %s per block session", device_id,
                format_bytes(with_one - session_bytes), format_bytes(session_bytes))
    return _CudaEnvironment(streams, providers, with_one - session_bytes, session_bytes,
                            gpu_profile_name(torch.cuda.get_device_name(device_id)), shared)


def _process_device_bytes(device_id: int) -> int:
    """Device memory in use on the GPU (the driver's counter)."""
    import torch

    free, total = torch.cuda.mem_get_info(device_id)
    return total - free


def cuda_facts(device_id: int) -> dict:
    """What the CUDA environment measured and chose (for benchmarks and logs)."""
    env = _cuda_environment(device_id)
    return {"device_overhead_bytes": env.overhead_bytes, "device_session_bytes": env.session_bytes,
            "shared_cuda_arena": env.shared_arena, "profile": env.profile_name,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "ep_devices": _ep_device_names()}


def _ep_device_names() -> list[str]:
    try:
        return [f"{d.ep_name}:{d.device.type}" for d in ort.get_ep_devices()]
    except Exception as e:  # an onnxruntime without the plugin-EP API
        return [f"unavailable ({type(e).__name__})"]


def cuda_backend(device_id: int, *, release_block_workspace: bool = True) -> DeviceBackend:
    """The CUDA device's backend on GPU ``device_id`` (checked first)."""
    check_cuda(device_id)
    env = _cuda_environment(device_id)
    used_bytes = lambda: _process_device_bytes(device_id) - env.overhead_bytes  # noqa: E731
    run_options = ort.RunOptions()
    # ORT_OFFLOAD_CUDA_SYNC=1 (a diagnostic): every block run and copy is waited for as it is
    # issued, so a result that changes with it points at a missing ordering between streams.
    serialize = os.environ.get("ORT_OFFLOAD_CUDA_SYNC") == "1"
    if not serialize:
        # Blocks are queued on the compute stream back to back; the host waits only where it
        # reads device bytes (fetches, swap-out copies it keeps, checkpoints).
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    if release_block_workspace:
        run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", f"gpu:{device_id}")
    streams = env.streams
    return DeviceBackend(
        TorchMemory(f"cuda:{device_id}"), StreamCopyEngine("h2d", streams, serialize=serialize),
        StreamCopyEngine("d2h", streams, serialize=serialize), env.providers, streams=streams, overhead_bytes=env.overhead_bytes, used_bytes=used_bytes,
        counter=PeakSampler(used_bytes), session_bytes=env.session_bytes, scatters_race=True,
        run_options=run_options, profile_name=env.profile_name,
    )


def gpu_profile_name(device_name: str) -> str:
    """The device profile closest to the GPU called ``device_name``."""
    for known in ("H200", "H100", "A100", "V100"):
        if known in device_name:
            return {"A100": "A100-80GB", "V100": "V100-16GB-PCIe3"}.get(known, known)
    return "H100"


def make_backend(device) -> DeviceBackend:
    """The backend of an :class:`~ort_offload.runtime.offload_device.OffloadDevice`."""
    if device.kind == "cuda":
        # Giving the workspace back costs cudaFree and cudaMalloc per block (54 ms a step of gpt
        # medium's 0.5x recompute plan on an H200): only a budget needs it.
        release = (device.release_block_workspace if device.release_block_workspace is not None
                   else device.budget is not None)
        return cuda_backend(device.device_id, release_block_workspace=release)
    return cpu_backend()
