"""Block sessions: the ORT options every block runs with, and what makes two blocks' sessions
interchangeable."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graph_passes.ir.program import Block
from ort_offload.runtime.block_session import block_content_key, block_model, default_session_options, shared_cpu_arena

ELEMENTS = 1 << 23  # 32 MiB per float intermediate


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model_with_large_intermediates() -> bytes:
    """sum(x * x + x): two 32 MiB values that ORT allocates in its own arena."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["square"]),
         helper.make_node("Add", ["square", "x"], ["total"]),
         helper.make_node("ReduceSum", ["total"], ["y"], keepdims=0)],
        "large_intermediates",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ELEMENTS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory is read from /proc")
def test_block_sessions_share_one_cpu_arena():
    """Sessions made with the block options reuse the memory an earlier session's run took for
    its internal values: six sessions, each holding 64 MiB of intermediates in its run, add
    about one session's worth to the process, not six (each kept alive, as the runner keeps
    its block sessions)."""
    assert shared_cpu_arena()
    model = _model_with_large_intermediates()
    x = np.ones(ELEMENTS, dtype=np.float32)
    sessions = [ort.InferenceSession(model, default_session_options(), providers=["CPUExecutionProvider"])
                for _ in range(6)]
    assert sessions[0].run(None, {"x": x})[0] == 2.0 * ELEMENTS
    after_first = _resident_bytes()
    for session in sessions[1:]:
        assert session.run(None, {"x": x})[0] == 2.0 * ELEMENTS
    grown = _resident_bytes() - after_first
    assert grown < ELEMENTS * 4, f"the other five sessions' runs added {grown / 2**20:.0f} MiB"


def test_blocks_running_the_same_nodes_share_a_content_key_whatever_their_index_or_graph():
    def graph(extra_first: bool):
        nodes = [helper.make_node("Mul", ["x", "x"], ["square"]), helper.make_node("Add", ["square", "x"], ["y"])]
        if extra_first:  # another graph (a rewrite, say) with a node before the same two
            nodes.insert(0, helper.make_node("Neg", ["x"], ["unused"]))
        return helper.make_model(helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])]), opset_imports=[helper.make_opsetid("", 17)])

    types = {"x": TensorProto.FLOAT, "square": TensorProto.FLOAT, "y": TensorProto.FLOAT}
    key = lambda model, block, t=types: block_content_key(block_model(model, block, t))  # noqa: E731
    plain = key(graph(False), Block(0, (0, 1), ("x",), ("y",), 0))
    shifted = Block(3, (1, 2), ("x",), ("y",), 1 << 20)  # other index, positions and workspace
    assert key(graph(True), shifted) == plain
    assert key(graph(False), Block(0, (0,), ("x",), ("square",), 0)) != plain  # other nodes
    assert key(graph(False), Block(0, (0, 1), ("x",), ("y",), 0), {"x": TensorProto.DOUBLE, "square": TensorProto.DOUBLE, "y": TensorProto.DOUBLE}) != plain
    sub = block_model(graph(True), shifted, types)
    name = sub.graph.name
    block_content_key(sub)
    assert sub.graph.name == name  # the model is left as it was


@pytest.mark.parametrize("elem_types", [True, False], ids=["elem-type-ints", "numpy-dtypes"])
def test_kept_bindings_follow_every_change_of_pointers_and_shapes(monkeypatch, elem_types):
    """A block keeps one binding per layout it ran at (BINDINGS_PER_VARIANT of them): runs at
    layouts seen before, new ones, ones that take over the oldest binding, and shape changes
    at the same pointers each read and write exactly the tensors of their own layout (binding
    element types as integers, where onnxruntime takes them, or as numpy dtypes)."""
    from graph_passes.ir.shapes import TensorInfo
    from ort_offload.runtime import block_session
    from ort_offload.runtime.block_session import BINDINGS_PER_VARIANT, BlockSession

    if elem_types and not block_session._binds_take_elem_types():
        pytest.skip("this onnxruntime binds numpy dtypes only")
    monkeypatch.setattr(block_session, "_binds_take_elem_types", lambda: elem_types)

    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z"])], "add",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in ("x", "y")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n"])]), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    types = {n: TensorProto.FLOAT for n in ("x", "y", "z")}
    session = BlockSession(model, Block(0, (0,), ("x", "y"), ("z",), 0), types, session_options=default_session_options())
    sources = [np.full(8, 2.0 ** i, dtype=np.float32) for i in range(6)]  # every pair has its own sum
    targets = [np.empty(8, dtype=np.float32) for _ in range(3)]
    rng = np.random.default_rng(0)
    layouts = set()
    for _ in range(60):
        i, j = rng.choice(len(sources), 2, replace=False)
        k, n = int(rng.integers(len(targets))), int(rng.choice([4, 8]))
        for target in targets:
            target[...] = -1.0
        infos = {name: TensorInfo(np.dtype(np.float32), (n,)) for name in ("x", "y", "z")}
        pointers = {"x": sources[i].ctypes.data, "y": sources[j].ctypes.data, "z": targets[k].ctypes.data}
        session.run(pointers, infos)
        layouts.add((i, j, k, n))
        expected = np.full(8, -1.0, dtype=np.float32)
        expected[:n] = sources[i][0] + sources[j][0]
        assert targets[k].tobytes() == expected.tobytes(), (i, j, k, n)
        assert all((t == -1.0).all() for m, t in enumerate(targets) if m != k)
    assert len(layouts) > BINDINGS_PER_VARIANT  # bindings were taken over, not only reused
