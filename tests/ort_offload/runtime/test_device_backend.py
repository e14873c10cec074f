"""The CUDA device's device-independent parts, on the CPU: stream copy engines ordered by events,
an arena in torch memory reserved as far as its tensors reach, and training through that path
bitwise equal to the CPU device."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

import ort_offload
from graph_passes.ir.shapes import TensorInfo
from helpers import batches, train_ort
from ort_offload.runtime import runner as runtime_module
from ort_offload.runtime.arena import DeviceArena
from ort_offload.runtime.host_slots import HostSlots, signature_values
from ort_offload.runtime.device_backend import gpu_profile_name, parse_cuda_kind, stream_backend
from ort_offload.runtime.device_memory import NumpyMemory, TorchMemory
from ort_offload.errors import UnknownDeviceError
from ort_offload.runtime.streams import StreamCopyEngine


class _RecordingEvent:
    def __init__(self, log, finished):
        self.log, self.finished, self.stream = log, finished, None

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream))

    def query(self):
        return self.finished

    def synchronize(self):
        self.log.append(("synchronize", self.stream))
        self.finished = True


class _RecordingStreams:
    """Streams that log what the engine asks of them; events finish when synchronized."""

    def __init__(self):
        self.log, self.compute, self.current, self.made = [], "compute", "compute", 0

    def new_stream(self):
        self.made += 1
        return f"copy{self.made}"

    def new_event(self):
        return _RecordingEvent(self.log, finished=False)

    @contextlib.contextmanager
    def using(self, stream):
        previous, self.current = self.current, stream
        yield
        self.current = previous

    def wait_event(self, stream, event):
        self.log.append(("wait", stream, event.stream))

    def synchronize(self):
        self.log.append(("device synchronize",))

    def pointer(self, stream):
        return None


def test_a_stream_copy_starts_after_the_compute_stream_and_is_consumed_on_the_device():
    streams = _RecordingStreams()
    engine = StreamCopyEngine("h2d", streams)
    ran_on = []
    engine.submit("x", lambda: ran_on.append(streams.current))
    assert ran_on == ["copy1"]  # issued on the engine's own stream
    assert streams.log[:2] == [("record", "compute"), ("wait", "copy1", "compute")]
    assert streams.log[2] == ("record", "copy1")  # the completion event
    assert engine.in_flight("x") and not engine.done("x")
    waited, finished = engine.consume("x")
    assert (waited, finished) == (0.0, False)
    assert streams.log[-1] == ("wait", "compute", "copy1")  # the compute stream waits, not the host
    assert not any(entry[0] == "synchronize" for entry in streams.log)
    assert not engine.in_flight("x")


def test_a_stream_copy_the_host_needs_is_waited_for_on_the_host():
    streams = _RecordingStreams()
    engine = StreamCopyEngine("d2h", streams)
    engine.submit("y", lambda: None)
    engine.submit("z", lambda: None)
    assert engine.pending() == ["y", "z"]
    _, finished = engine.wait("y")
    assert not finished and ("synchronize", "copy1") in streams.log
    engine.drain()
    assert engine.pending() == []


@pytest.mark.parametrize("memory", [NumpyMemory(), TorchMemory("cpu")], ids=["numpy", "torch"])
def test_arena_bytes_round_trip_through_either_memory(memory):
    arena = DeviceArena(1 << 16, memory=memory)
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.array([True, False, True])
    arena.store("a", a)
    arena.store("b", b)
    arena.store("c", np.ones(5, dtype=np.int64))
    arena.free("a")
    arena.compact()  # moves b and c down over a's place
    np.testing.assert_array_equal(arena.read("b"), b)
    np.testing.assert_array_equal(arena.read("c"), np.ones(5, dtype=np.int64))
    target = memory.host_empty(TensorInfo(np.dtype(np.int64), (5,)))
    arena.downloader("c", target)()
    np.testing.assert_array_equal(target, np.ones(5, dtype=np.int64))
    arena.uploader("c", np.full(5, 7, dtype=np.int64))()
    np.testing.assert_array_equal(arena.read("c"), np.full(5, 7, dtype=np.int64))


def test_a_device_arena_reserves_what_its_tensors_reach_not_the_budget():
    arena = DeviceArena(64 << 20, memory=TorchMemory("cpu"))
    assert arena.reserved_bytes == 0
    arena.store("w", np.ones(1000, dtype=np.float32))
    assert 4000 <= arena.reserved_bytes < 64 << 20
    arena.store("v", np.full(300_000, 2.0, dtype=np.float32))  # grows, keeping w in place
    assert arena.reserved_bytes >= arena.allocator.high_water_live()
    np.testing.assert_array_equal(arena.read("w"), np.ones(1000, dtype=np.float32))
    np.testing.assert_array_equal(arena.read("v"), np.full(300_000, 2.0, dtype=np.float32))
    arena.reserve(8 << 20)
    assert arena.reserved_bytes == 8 << 20
    assert arena.regrowths >= 1


def test_a_host_arena_reserves_its_cap_at_once():
    arena = DeviceArena(1 << 20, memory=NumpyMemory())
    assert arena.reserved_bytes == 1 << 20


@contextlib.contextmanager
def stream_path():
    """Trainers made inside run the CUDA device's path (torch memory, stream copy engines)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime_module, "make_backend", lambda device: stream_backend())
        yield


@pytest.mark.parametrize("budget,options", [
    (None, {}),
    ("0.5x", {"async_swap_outs": True}),
    ("0.7x", {"passes": "recompute"}),
], ids=["unlimited", "swap-async", "recompute"])
def test_training_through_the_stream_path_is_bitwise_the_cpu_device(budget, options):
    reference = train_ort("gpt", optimizer="adamw", steps=3, budget=budget, **options)
    with stream_path():
        run = train_ort("gpt", optimizer="adamw", steps=3, budget=budget, **options)
    assert isinstance(run.trainer.runtime.arena.memory, TorchMemory)
    assert run.trainer.report()["within_budget"]
    assert run.losses == reference.losses
    for name, value in reference.state.items():
        np.testing.assert_array_equal(run.state[name], value, err_msg=name)


def test_swapped_runs_through_the_stream_path_move_bytes():
    with stream_path():
        run = train_ort("gpt", optimizer="adamw", steps=2, budget="0.3x", async_swap_outs=True)
    report = run.trainer.report()
    assert report["swap_out_bytes"] > 0 and report["swap_in_bytes"] > 0
    assert report["faults"] == 0 and report["within_budget"]
    # Blocks cut between a shape computation and its Reshape read the shape folded in, once
    # per signature (the values follow from the input shapes).
    assert run.trainer.runner.host_value_cache


@pytest.mark.parametrize("policy", ["static", "input_aware"])
def test_variable_lengths_through_the_stream_path_are_bitwise_with_one_session_per_block(policy):
    data = batches("bert", 4, seq_lengths=[64, 40, 24, 56])
    options = dict(optimizer="adamw", steps=4, budget="0.62x", passes="recompute", data=data, recompute_policy=policy)
    reference = train_ort("bert", **options)
    with stream_path():
        run = train_ort("bert", **options)
    assert run.trainer.report()["within_budget"]
    assert run.trainer.runner.recompute.summary()["policy"] == policy
    assert any(p.recomputed_nodes for p in run.trainer.runner.prepared_steps())
    assert run.losses == reference.losses
    for name, value in reference.state.items():
        np.testing.assert_array_equal(run.state[name], value, err_msg=name)
    # Shapes that follow from the input shapes alone are ORT's to compute, as in a whole-graph
    # session: no block holds one session per length (on CUDA each holds device memory).
    assert run.trainer.runner.session_count == reference.trainer.runner.session_count


def _model(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


def test_host_slot_values_are_computed_on_the_host_and_folded_as_initializers():
    sub = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x, int64[1] rows, float[3,4] y) => (float[3,4] out, float[4,3] out2) {
            shape = Concat <axis = 0> (rows, rows)
            r = Reshape (x, shape)
            s = Shape (y)
            two = Constant <value = int64[1] {-1}> ()
            rev = Slice (s, two, two)
            t = Concat <axis = 0> (s, rows)
            out = Reshape (r, s)
            out2 = Transpose <perm = [1, 0]> (out)
        }""")
    slots = HostSlots(sub, ["x", "rows", "y"])
    assert slots.active and slots.inputs == {"rows"}  # not x (data) nor y (its shape is in infos)
    infos = {"y": TensorInfo(np.dtype(np.float32), (3, 4))}
    values = slots.compute({"rows": np.array([2], dtype=np.int64)}, infos)
    assert set(values) == {"shape", "s", "two"}  # every value in a host slot
    np.testing.assert_array_equal(values["shape"], [2, 2])
    np.testing.assert_array_equal(values["s"], [3, 4])
    folded = slots.fold(values)
    reshapes = [n for n in folded.graph.node if n.op_type == "Reshape"]
    assert [n.input[1] for n in reshapes] == ["shape__host", "s__host"]
    assert {"shape__host", "s__host"} <= {t.name for t in folded.graph.initializer}


def test_a_block_whose_slots_read_float_inputs_is_left_alone():
    sub = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x, float[2] f) => (float[3,4] out) {
            shape = Cast <to = 7> (f)
            out = Reshape (x, shape)
        }""")
    assert not HostSlots(sub, ["x", "f"]).active


def test_signature_values_are_those_computed_from_shapes_and_constants():
    model = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x, int64[2] data_shape) => (float[3,4] out) {
            s = Shape (x)
            two = Constant <value = int64[1] {2}> ()
            t = Div (s, two)
            mixed = Add (t, data_shape)
            out = Reshape (x, mixed)
        }""")
    values = signature_values(model)
    assert {"s", "two", "t"} <= values
    assert "mixed" not in values and "out" not in values


def test_cuda_device_names_parse():
    assert parse_cuda_kind("cuda", None) == 0
    assert parse_cuda_kind("cuda:1", None) == 1
    assert parse_cuda_kind("cuda", 2) == 2
    with pytest.raises(UnknownDeviceError):
        parse_cuda_kind("cuda:x", None)
    with pytest.raises(UnknownDeviceError):
        parse_cuda_kind("cuda:1", 0)
    assert gpu_profile_name("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_profile_name("NVIDIA H200") == "H200"


def test_a_cuda_device_without_onnxruntime_gpu_is_one_clear_error():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this environment has onnxruntime-gpu")
    with pytest.raises(UnknownDeviceError, match="onnxruntime-gpu") as info:
        ort_offload.set_offload_device("cuda", budget="0.5x")
    assert "\n" not in str(info.value)
    with pytest.raises(UnknownDeviceError, match="needs a CUDA device"):
        ort_offload.set_offload_device("cpu", device_id=1)


def test_a_dynamic_network_on_a_cuda_device_is_refused():
    from ort_offload.runtime.offload_device import OffloadDevice
    from models import get_dynamic_model

    spec = get_dynamic_model("var-lstm", "tiny")
    with pytest.raises(UnknownDeviceError, match="CPU device only"):
        ort_offload.create_ort_trainer(OffloadDevice(kind="cuda"), spec.model, loss_fn=spec.loss_fn)


def test_an_input_read_whole_and_by_shape_is_fed_once():
    sub = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x, int64[2] dims) => (float[3,4] out) {
            s = Shape (dims)
            shape = Concat <axis = 0> (dims, s)
            trimmed = Slice (shape, s, s)
            out = Reshape (x, dims)
        }""")
    slots = HostSlots(sub, ["x", "dims"])
    assert slots.inputs == {"dims"}
    values = slots.compute({"dims": np.array([3, 4], dtype=np.int64)}, {})
    np.testing.assert_array_equal(values["dims"], [3, 4])
    np.testing.assert_array_equal(values["s"], [2])


@pytest.mark.parametrize("memory", [NumpyMemory(), TorchMemory("cpu")], ids=["numpy", "torch"])
def test_finiteness_is_read_where_the_tensors_live(memory):
    arena = DeviceArena(1 << 16, memory=memory)
    arena.store("good", np.ones(7, dtype=np.float32))
    arena.store("bad", np.array([1.0, np.inf], dtype=np.float32))
    arena.store("huge", np.full(4, 3e38, dtype=np.float32))  # the sum overflows; every element is finite
    assert arena.finite(["good", "bad", "huge"]) == [True, False, True]


def test_the_peak_sampler_sees_a_value_held_only_while_the_step_runs():
    import time

    from ort_offload.runtime.device_counter import PeakSampler

    level = {"bytes": 10}
    sampler = PeakSampler(lambda: level["bytes"], interval_s=0.0002)
    with sampler.sampling():
        level["bytes"] = 500  # a block's workspace, given back before the step ends
        before = sampler.samples
        deadline = time.perf_counter() + 30.0  # a loaded machine may not schedule the thread soon
        while sampler.samples < before + 2 and time.perf_counter() < deadline:
            time.sleep(0.001)
        level["bytes"] = 20
    assert sampler.samples >= before + 2
    assert sampler.peak == 500


@contextlib.contextmanager
def stream_path_with_sessions(session_bytes: int, device_bytes):
    """The stream path with a device whose block sessions each hold ``session_bytes`` and whose
    counter reads ``device_bytes()``."""
    from ort_offload.runtime.device_counter import PeakSampler

    def backend(device):
        made = stream_backend()
        made.session_bytes = session_bytes
        made.used_bytes = device_bytes
        made.counter = PeakSampler(device_bytes)
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime_module, "make_backend", backend)
        yield


@pytest.mark.parametrize("passes,fraction", [("swap", "0.6x"), ("recompute", "0.75x")])
def test_block_sessions_memory_is_taken_from_the_budget(passes, fraction):
    """Each block session's own bytes (CUDA library handles) count against the budget: the plan
    leaves room for them, the accounting adds them, and the numbers stay bitwise."""
    options = {"async_swap_outs": True} if passes == "swap" else {"passes": "recompute"}
    reference = train_ort("gpt", optimizer="adamw", steps=2, budget=fraction, **options)
    budget = reference.trainer.runtime.budget_bytes
    per_session = budget // 400  # about what a CUDA session holds beside a 4 GB budget
    with stream_path_with_sessions(per_session, lambda: 0):
        run = train_ort("gpt", optimizer="adamw", steps=2, budget=budget, **options)
    report = run.trainer.report()
    sessions = run.trainer.runner.session_count
    assert sessions >= 1 and report["block_sessions"] == sessions
    assert report["device_session_bytes"] == per_session
    assert report["accounted_peak_bytes"] >= sessions * per_session
    assert report["accounted_peak_bytes"] <= budget
    assert run.losses == reference.losses


@pytest.mark.slow  # plans and runs until the sessions fill the budget (~30 s)
def test_a_budget_the_block_sessions_fill_is_one_clear_error():
    from ort_offload.errors import BudgetTooSmallError

    reference = train_ort("gpt", optimizer="adamw", steps=1, budget="0.6x", async_swap_outs=True)
    budget = reference.trainer.runtime.budget_bytes
    with stream_path_with_sessions(budget, lambda: 0), pytest.raises(BudgetTooSmallError, match="raise the budget"):
        train_ort("gpt", optimizer="adamw", steps=1, budget=budget, async_swap_outs=True)


def test_the_device_counter_is_the_reported_peak_where_a_device_has_one():
    readings = iter(range(1000, 10**9, 1000))
    with stream_path_with_sessions(0, lambda: next(readings)):
        run = train_ort("gpt", optimizer="adamw", steps=2)
    report = run.trainer.report()
    assert report["peak_device_bytes"] == run.trainer.runtime.backend.counter.peak
    assert report["peak_device_bytes"] > 1000


@contextlib.contextmanager
def stream_path_with_racing_scatters():
    """The stream path on a device whose scatter-adds race (CUDA): they run as one-hot products."""
    def backend(device):
        made = stream_backend()
        made.scatters_race = True
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime_module, "make_backend", backend)
        yield


def test_scatter_adds_run_as_one_hot_products_where_they_race_and_plans_stay_bitwise():
    reference = train_ort("gpt", optimizer="adamw", steps=3)
    with stream_path_with_racing_scatters():
        unplanned = train_ort("gpt", optimizer="adamw", steps=3)
        planned = train_ort("gpt", optimizer="adamw", steps=3, budget="0.5x", async_swap_outs=True)
    ops = [n.op_type for n in unplanned.trainer.runner.model.graph.node]
    assert "ScatterND" not in ops and "OneHot" in ops
    assert planned.losses == unplanned.losses
    for name, value in unplanned.state.items():
        np.testing.assert_array_equal(planned.state[name], value, err_msg=name)
    np.testing.assert_allclose(unplanned.losses, reference.losses, rtol=1e-6)


@pytest.mark.parametrize("shift", [1, 7, 100, 999])
def test_an_overlapping_move_through_a_small_staging_buffer_keeps_every_byte(shift):
    from ort_offload.runtime import device_memory

    memory = TorchMemory("cpu")
    buffer = memory.allocate(4096, 64)
    values = np.random.default_rng(shift).integers(0, 256, 4096, dtype=np.uint8)
    memory.write(buffer, 0, values)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device_memory, "MOVE_STAGING_BYTES", 64)  # many pieces
        memory.move(buffer, 1000, 1000 - shift, 3000)
    moved = memory.read(buffer, 1000 - shift, TensorInfo(np.dtype(np.uint8), (3000,)))
    np.testing.assert_array_equal(moved, values[1000:4000])
