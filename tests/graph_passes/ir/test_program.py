"""Lowering into blocks: structure on hand-built graphs, exact equivalence with one session,
and the memory replay that the runtime's peak is measured against."""

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graph_passes.ir import shapes
from graph_passes.ir.liveness import lifetimes
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Commit, Fetch, Load, RunBlock, lower, partition
from graph_passes.ir.training_graph import Role, TrainingGraph
from helpers import batches, chain_body, step_graph_and_feeds
from ort_offload.device import set_offload_device
from ort_offload.runtime.runner import GraphRunner, Runtime

# A two-layer "training step" in onnx text: w1/w2 are state updated by a fake optimizer.
STEP = """
<ir_version: 9, opset_import: ["" : 20]>
step (float[N, 8] x, float[8, 8] w1, float[8, 4] w2) => (float loss, float[8, 8] w1_new, float[8, 4] w2_new) {
    h = MatMul(x, w1)
    a = Relu(h)
    o = MatMul(a, w2)
    s = Softmax(o)
    loss = ReduceMean<keepdims = 0>(s)
    sa = Sigmoid(a)
    ax = Constant<value = int64[1] {0}>()
    g1 = ReduceMean<keepdims = 1>(sa, ax)
    c = Constant<value = float {0.5}>()
    d1 = Mul(g1, c)
    w1_new = Sub(w1, d1)
    g2 = ReduceMean<keepdims = 1>(o, ax)
    d2 = Mul(g2, c)
    w2_new = Sub(w2, d2)
}
"""


def step_graph() -> TrainingGraph:
    model = onnx.parser.parse_model(STEP)
    onnx.checker.check_model(model)
    roles = {"x": Role.INPUT, "w1": Role.PARAM, "w2": Role.PARAM, "loss": Role.LOSS,
             "w1_new": Role.PARAM, "w2_new": Role.PARAM}
    for node in model.graph.node:
        for out in node.output:
            roles.setdefault(out, Role.ACTIVATION)
    return TrainingGraph(model, roles, {"w1": "w1_new", "w2": "w2_new"}, name="step")


def feeds(batch=5, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 8)).astype(np.float32),
            "w1": rng.standard_normal((8, 8)).astype(np.float32),
            "w2": rng.standard_normal((8, 4)).astype(np.float32)}


def test_partition_is_even_and_covers_every_position():
    chunks = partition(10, 4)
    assert [len(c) for c in chunks] == [3, 4, 3]
    assert sum(chunks, ()) == tuple(range(10))
    assert partition(0, 4) == []


def test_lifetimes_end_at_last_use_and_outputs_live_to_the_end():
    graph = step_graph().graph
    life = lifetimes(graph)
    assert life["x"].birth == -1 and life["x"].last_use == 0
    assert life["loss"].last_use == len(graph.node)
    assert life["a"].last_use > life["h"].last_use


@pytest.mark.parametrize("block_nodes", [1, 2, 3, 5, 100])
def test_lowering_structure(block_nodes):
    g = step_graph()
    f = feeds()
    infos = shapes.infer_tensor_infos(g.model, shapes.check_inputs(g.model, f))
    program = lower(g.model, infos, state_pairs=g.state_pairs, data_inputs=["x"], max_block_nodes=block_nodes)
    assert program.state_inputs == ("w1", "w2")
    assert isinstance(program.steps[0], Load) and program.steps[0].name == "x"
    assert isinstance(program.steps[-1], Commit)
    assert program.steps[-1].renames == (("w1_new", "w1"), ("w2_new", "w2"))
    assert [s.name for s in program.steps if isinstance(s, Fetch)] == ["loss"]
    produced_before = {"x", "w1", "w2"}
    for step in program.steps:
        if isinstance(step, RunBlock):
            block = program.blocks[step.block]
            assert set(block.inputs) <= produced_before  # blocks read only what is resident
            produced_before |= set(block.outputs)
            assert all(n in produced_before for n in step.frees)
    # State replaced by its update is freed during the step; nothing else leaks.
    freed = [n for s in program.steps if isinstance(s, RunBlock) for n in s.frees]
    assert "w1" in freed and "w2" in freed and "x" in freed
    assert len(freed) == len(set(freed))


@pytest.mark.parametrize("block_nodes", [1, 2, 4, 100])
def test_block_runtime_equals_one_session_exactly(block_nodes):
    g = step_graph()
    f = feeds()
    reference = dict(zip(g.output_names, ort.InferenceSession(g.model.SerializeToString()).run(None, f)))
    runtime = Runtime(set_offload_device("cpu", max_block_nodes=block_nodes))
    runner = GraphRunner(runtime, g, fetches=["loss"])
    prepared = runner.prepare(shapes.check_inputs(g.model, f))
    runtime.place_state(f, prepared.program.state_inputs, runner.capacity_for(prepared))
    out = runner.run({"x": f["x"]}, prepared)
    assert out["loss"].tobytes() == reference["loss"].tobytes()
    np.testing.assert_array_equal(runtime.read("w1"), reference["w1_new"])
    np.testing.assert_array_equal(runtime.read("w2"), reference["w2_new"])
    # Measured peak is the replayed peak: same allocator, same sequence.
    assert runtime.stats.peak_device_bytes <= prepared.trace.peak_device_bytes
    assert runtime.stats.peak_device_bytes >= prepared.trace.min_budget_bytes


def test_workspace_counts_only_values_inside_a_block():
    g = step_graph()
    f = feeds(batch=64)
    infos = shapes.infer_tensor_infos(g.model, shapes.check_inputs(g.model, f))
    one = lower(g.model, infos, state_pairs=g.state_pairs, data_inputs=["x"], max_block_nodes=1)
    whole = lower(g.model, infos, state_pairs=g.state_pairs, data_inputs=["x"], max_block_nodes=100)
    assert one.max_workspace_bytes == 0  # every value crosses a block boundary
    assert whole.max_workspace_bytes >= infos["h"].nbytes + infos["a"].nbytes
    assert simulate_program(one, infos).arena_high_water > simulate_program(whole, infos).arena_high_water


def test_shape_inference_falls_back_to_a_probe_run():
    # NonZero's output length depends on data: inference cannot know it, the probe does.
    model = onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 20]>
    g (float[4] x) => (float y) {
        nz = NonZero(x)
        f = Cast<to = 1>(nz)
        y = ReduceSum<keepdims = 0>(f)
    }""")
    x = np.array([0, 1, 0, 2], dtype=np.float32)
    infos = shapes.infer_tensor_infos(model, shapes.check_inputs(model, {"x": x}), probe_feeds={"x": x})
    assert infos["nz"].shape == (1, 2)


def test_inferred_infos_share_one_object_per_shape():
    # A runner keeps every signature's infos: equal (dtype, shape) pairs are one object, across
    # values and across calls, so kept infos do not grow with the number of values.
    model = step_graph().model
    first = shapes.infer_tensor_infos(model, shapes.check_inputs(model, feeds(batch=5)))
    again = shapes.infer_tensor_infos(model, shapes.check_inputs(model, feeds(batch=5)))
    other = shapes.infer_tensor_infos(model, shapes.check_inputs(model, feeds(batch=7)))
    assert first["h"] == first["a"] and first["h"] is first["a"]
    assert all(again[name] is info for name, info in first.items())
    assert other["h"].shape == (7, 8) and other["h"] is not first["h"]
    assert other["w1"] is first["w1"]


def test_shape_inference_pins_what_the_last_signature_needed_first_with_the_same_infos(monkeypatch):
    # bert's Reshape targets are computed from the sequence length: inference stops at them
    # until their integer inputs are pinned. At a second length they are pinned up front.
    graph, feeds, _ = step_graph_and_feeds("bert")
    model = graph.model
    rounds = []
    infer_shapes = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: rounds.append(1) or infer_shapes(*a, **k))
    inference = shapes.ShapeInference(model)
    counts = []
    for seq in (32, 48):
        (inputs, targets), = batches("bert", 1, seq_lengths=[seq])
        signature = dict(feeds, **{n: t.numpy() for n, t in zip(graph.data_inputs, inputs + targets)})
        input_infos = shapes.check_inputs(model, signature)
        rounds.clear()
        expected = shapes.infer_tensor_infos(model, input_infos)
        plain = len(rounds)
        rounds.clear()
        assert inference(input_infos) == expected
        counts.append((plain, len(rounds)))
    assert inference.pin_first
    assert counts[0][0] == counts[0][1] >= 2 and counts[1] == (counts[0][0], counts[0][0] - 1)


def test_shape_inference_reuses_the_pinned_values_probe_across_signatures(monkeypatch):
    # The probe of the values pinned up front reads the model's dynamic inputs, so one session
    # serves every later signature; its values (and so the infos) are still this signature's.
    graph, feeds, _ = step_graph_and_feeds("bert")
    model = graph.model
    signatures = []
    for seq in (32, 48, 64):
        (inputs, targets), = batches("bert", 1, seq_lengths=[seq])
        signature = dict(feeds, **{n: t.numpy() for n, t in zip(graph.data_inputs, inputs + targets)})
        input_infos = shapes.check_inputs(model, signature)
        signatures.append((input_infos, shapes.infer_tensor_infos(model, input_infos)))
    built = []
    probe_session = shapes._probe_session
    monkeypatch.setattr(shapes, "_probe_session", lambda m, names: built.append(tuple(names)) or probe_session(m, names))
    inference = shapes.ShapeInference(model)
    per_signature = []
    for input_infos, expected in signatures:
        before = len(built)
        assert inference(input_infos) == expected
        per_signature.append(built[before:])
    assert inference.pin_first
    assert per_signature[0]  # the first signature probes what inference stops at
    assert per_signature[1] == [inference.pin_first]  # built once, on the dynamic model
    assert per_signature[2] == []  # reused


def test_new_signatures_are_prepared_with_the_collector_paused(monkeypatch):
    # Preparing makes many short-lived objects; with the collector on they trigger full passes
    # over every object in the process. Off while preparing, back to how it was afterwards,
    # also when preparing fails; a cached signature is not prepared again.
    import gc

    g = step_graph()
    runner = GraphRunner(Runtime(set_offload_device("cpu")), g, fetches=["loss"])
    seen = []
    infer = runner.planner.infer_infos

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return infer(*args, **kwargs)

    monkeypatch.setattr(runner.planner, "infer_infos", recording)
    assert gc.isenabled()
    runner.prepare(shapes.check_inputs(g.model, feeds(batch=5)))
    runner.prepare(shapes.check_inputs(g.model, feeds(batch=5)))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        runner.prepare(shapes.check_inputs(g.model, feeds(batch=6)))
        assert seen == [False, False] and not gc.isenabled()  # left off, as the caller had it
    finally:
        gc.enable()

    def failing(*args, **kwargs):
        raise RuntimeError("shape inference failed")

    monkeypatch.setattr(runner.planner, "infer_infos", failing)
    with pytest.raises(RuntimeError):
        runner.prepare(shapes.check_inputs(g.model, feeds(batch=7)))
    assert gc.isenabled()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["Relu", "Sigmoid", "Neg", "Exp", "MatMul", "Add", "Concat"]), min_size=1, max_size=12),
       st.integers(1, 6))
def test_random_chains_match_one_session(ops, block_nodes):
    """Random chains/branches of standard ops: the block runtime gives the session's bytes."""
    lines, last = chain_body(ops)
    text = ("<ir_version: 9, opset_import: [\"\" : 20]>\n"
            "g (float[3, 4] x, float[4, 4] w, float[8, 4] w2) => (float[3, 4] y) {\n"
            + "\n".join(lines) + f"\n y = Identity({last})\n}}")
    model = onnx.parser.parse_model(text)
    roles = {"x": Role.INPUT, "w": Role.PARAM, "w2": Role.PARAM, "y": Role.LOSS}
    g = TrainingGraph(model, roles, {}, name="chain")
    rng = np.random.default_rng(1)
    f = {"x": rng.standard_normal((3, 4)).astype(np.float32), "w": rng.standard_normal((4, 4)).astype(np.float32),
         "w2": rng.standard_normal((8, 4)).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString()).run(None, f)[0]
    runtime = Runtime(set_offload_device("cpu", max_block_nodes=block_nodes))
    runner = GraphRunner(runtime, g, fetches=["y"])
    prepared = runner.prepare(shapes.check_inputs(model, f))
    runtime.place_state(f, prepared.program.state_inputs, runner.capacity_for(prepared))
    out = runner.run({"x": f["x"]}, prepared)["y"]
    assert out.tobytes() == expected.tobytes()
