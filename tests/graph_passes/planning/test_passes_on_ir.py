"""The rewrite passes on ``onnx_ir`` models: each writes, node for node, the graph it wrote when
it rewrote protobuf (the listings in ``data/pass_listings.txt`` were written by those passes),
and a pass manager composing two of them writes what applying them one after another writes,
which stock ONNX Runtime runs with the numbers of the graph before."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes
import onnxruntime as ort
import pytest

from custom_ops.registry import DOMAIN
from graph_passes.ir.program import SwapIn, SwapOut, lower
from graph_passes.planning.recompute.graph_pass import RecomputePass, recomputed_infos, write_recompute_plan
from graph_passes.planning.recompute.planner import RecomputePlan, Segment
from graph_passes.planning.split.graph_pass import Cut, SplitPass, SplitPlan, SplitRun, write_split_plan
from graph_passes.planning.split.rules import CHAIN, CONCAT, SUM, SplitAxis
from graph_passes.planning.swap.graph_pass import SwapPass
from graph_passes.planning.swap.planner import SwapPlan
from split_helpers import infos_for

LISTINGS = pathlib.Path(__file__).parent / "data" / "pass_listings.txt"

# A training step in miniature: forward h1 -> a1 -> h2 -> a2 -> loss, a backward reading a1,
# a2 and h1, and two state updates.
STEP = """<ir_version: 10, opset_import: ["" : 20]>
step (float[8, 8] x, float[8, 8] w1, float[8, 8] w2) => (float loss, float[8, 8] w1_new, float[8, 8] w2_new)
{
    h1 = MatMul(x, w1)
    a1 = Relu(h1)
    h2 = MatMul(a1, w2)
    a2 = Tanh(h2)
    loss = ReduceSum<keepdims = 0>(a2)
    g2 = Mul(a2, a2)
    gw2 = MatMul(a1, g2)
    gh1 = Mul(g2, h1)
    gw1 = MatMul(x, gh1)
    w2_new = Sub(w2, gw2)
    w1_new = Sub(w1, gw1)
}
"""
STATE = {"w1": "w1_new", "w2": "w2_new"}
# Both segments recomputed: the second reads a1 (its checkpoint), so only h1 is re-created of the first.
RECOMPUTE = RecomputePlan((Segment(0, (0, 1), ("h1", "a1"), 512), Segment(1, (2, 3), ("a2",), 256)))

# Every kind of merge: a concat run (a graph output inside it), a sum (MatMul over K), a mean
# (a shape constant read), a chain (ScatterElements along its indices).
SPLIT_GRAPH = """<ir_version: 10, opset_import: ["" : 20]>
agraph (float[8, 6] x, float[8, 6] res, float s, float[6, 4] w, int64[8, 6] idx, float[8, 6] upd)
    => (float[8, 6] y, float[8, 6] h, float[8, 4] m, float[1, 6] r, float[8, 6] sc)
{
    a = Mul(x, s)
    h = Relu(a)
    side = Neg(res)
    b = Add(h, res)
    c = Add(b, side)
    y = Tanh(c)
    m = MatMul(y, w)
    axes = Constant<value = int64[1] {0}>()
    r = ReduceMean<keepdims = 1>(x, axes)
    sc = ScatterElements<axis = 0>(res, idx, upd)
}
"""
SPLIT = SplitPlan((
    SplitRun((0, 1, 3, 4, 5), (SplitAxis(CONCAT, 0),) * 5, 2),
    SplitRun((6,), (SplitAxis(SUM, 1),), 3),
    SplitRun((8,), (SplitAxis(SUM, 0),), 2),
    SplitRun((9,), (SplitAxis(CHAIN, 0),), 2),
))
RNG = np.random.default_rng(3)


def _model(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def _step_feeds() -> dict[str, np.ndarray]:
    return {n: RNG.standard_normal((8, 8)).astype(np.float32) for n in ("x", "w1", "w2")}


def _split_feeds() -> dict[str, np.ndarray]:
    feeds = {n: RNG.standard_normal((8, 6)).astype(np.float32) for n in ("x", "res", "upd")}
    feeds.update(s=np.array(1.5, np.float32), w=RNG.standard_normal((6, 4)).astype(np.float32),
                 idx=np.stack([RNG.permutation(8) for _ in range(6)], axis=1).astype(np.int64))
    return feeds


def listing(model: onnx.ModelProto) -> list[str]:
    """One line per node (op, name, inputs, outputs, attributes, provenance), then the outputs."""
    lines = []
    for node in model.graph.node:
        op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        attributes = ", ".join(f"{a.name} = {onnx.numpy_helper.to_array(a.t).tolist()}" if a.type == a.TENSOR
                               else onnx.helper.printable_attribute(a) for a in node.attribute)
        meta = "; ".join(f"{p.key}={p.value}" for p in node.metadata_props)
        lines.append(f"{op} {node.name}: {','.join(node.input)} -> {','.join(node.output)} <{attributes}> {{{meta}}}")
    lines.append("outputs: " + ", ".join(f"{o.name}:{o.type.tensor_type.elem_type}" for o in model.graph.output))
    return lines


def _step_program(model: onnx.ModelProto, infos):
    return lower(model, infos, state_pairs=STATE, data_inputs=["x"], fetches=["loss"], max_block_nodes=2)


def _swap_plan() -> SwapPlan:
    """w1 starts on the host (in for the forward, dropped, in again for its update), a1 goes out
    between its forward and backward uses, and the new w1, a graph output, ends on the host."""
    before = ((1, (SwapIn("w1"),)), (2, (SwapOut("w1", copy=False),)), (3, (SwapOut("a1"),)),
              (4, (SwapIn("a1"),)), (6, (SwapIn("w1"),)), (7, (SwapOut("w1_new"),)))
    return SwapPlan(before, ("w1",), capacity=2**30, peak_in_use=0, swap_out_bytes=512, swap_in_bytes=768)


def recompute_case() -> onnx.ModelProto:
    return write_recompute_plan(_model(STEP), RECOMPUTE, loss_name="loss")[0]


def swap_case() -> onnx.ModelProto:
    model = _model(STEP)
    infos = infos_for(model, _step_feeds())
    result = SwapPass(_step_program(model, infos), _swap_plan(), infos, budget=2**30)(ir.from_proto(model))
    return ir.to_proto(result.model)


def split_case(cut: Cut) -> onnx.ModelProto:
    model = _model(SPLIT_GRAPH)
    plan = SPLIT if cut is Cut.SLICE else SplitPlan(SPLIT.runs[:1])
    return write_split_plan(model, plan, infos_for(model, _split_feeds()), cut=cut)[0]


CASES = {"recompute": recompute_case, "swap": swap_case, "split-slice": lambda: split_case(Cut.SLICE),
         "split-split": lambda: split_case(Cut.SPLIT)}


def _expected() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    for line in LISTINGS.read_text().splitlines():
        if line.startswith("== "):
            sections[line[3:]] = current = []
        elif line:
            current.append(line)
    return sections


@pytest.mark.parametrize("case", list(CASES))
def test_each_pass_writes_the_graph_it_wrote_on_protobuf(case):
    assert listing(CASES[case]()) == _expected()[case]


def _normal(model: onnx.ModelProto) -> bytes:
    """The model as ``onnx_ir`` writes it: the writers reuse the source's untouched ``NodeProto``s,
    which a parsed model spells with an explicit empty domain."""
    return ir.to_proto(ir.from_proto(model)).SerializeToString()


def test_one_writer_writes_plan_after_plan_each_as_if_alone():
    """The planner's writer converts its graph once and takes each plan out again after writing it."""
    from graph_passes.planning.recompute.graph_pass import RecomputeWriter

    model = _model(STEP)
    first, second = RecomputePlan(RECOMPUTE.segments[:1]), RecomputePlan(RECOMPUTE.segments[1:])
    writer = RecomputeWriter(model, loss_name="loss")
    written = [writer.write(plan) for plan in (RECOMPUTE, first, second, RecomputePlan(()), RECOMPUTE)]
    for (got, clones), plan in zip(written, (RECOMPUTE, first, second, RecomputePlan(()), RECOMPUTE)):
        pass_ = RecomputePass(plan, loss_name="loss")
        alone = ir.to_proto(pass_(ir.from_proto(model)).model)
        assert _normal(got) == alone.SerializeToString() and clones == pass_.clones
    assert [c for _, c in written] == [3, 2, 2, 0, 3]
    assert ir.to_proto(writer.model).SerializeToString() == ir.to_proto(ir.from_proto(model)).SerializeToString()


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_same_numbers(model: onnx.ModelProto, rewritten: onnx.ModelProto, feeds) -> None:
    onnx.checker.check_model(rewritten)
    for before, after in zip(_run(model, feeds), _run(rewritten, feeds)):
        np.testing.assert_array_equal(before, after)


def _step_of(program, node: int) -> int:
    """The program step that runs graph node ``node``."""
    return next(k for k, step in enumerate(program.steps)
                if getattr(step, "block", None) is not None and node in program.blocks[step.block].node_indices)


def _out_and_back(program, model: onnx.ModelProto, name: str, reader: str) -> SwapPlan:
    """``name`` swapped out after the step that last read it before ``reader``'s, in before that."""
    position = {o: k for k, n in enumerate(model.graph.node) for o in n.output}
    back = _step_of(program, position[reader])
    last = max(_step_of(program, k) for k, n in enumerate(model.graph.node)
               if name in n.input and _step_of(program, k) < back)
    return SwapPlan(((last + 1, (SwapOut(name),)), (back, (SwapIn(name),))), (), capacity=2**30, peak_in_use=0,
                    swap_out_bytes=0, swap_in_bytes=0)


def test_a_pass_manager_of_recompute_and_swap_writes_what_they_write_one_after_the_other():
    model, feeds = _model(STEP), _step_feeds()
    infos = infos_for(model, feeds)
    recomputed, clones = write_recompute_plan(model, RECOMPUTE, loss_name="loss")
    recomputed_infos_ = recomputed_infos(infos, recomputed)
    program = _step_program(recomputed, recomputed_infos_)
    plan = _out_and_back(program, recomputed, "a1", "gw2")  # after the forward and the clones read it

    def swap():
        return SwapPass(program, plan, recomputed_infos_, budget=2**30)

    one_after_the_other = ir.to_proto(swap()(ir.from_proto(recomputed)).model)
    manager = onnx_ir.passes.PassManager([RecomputePass(RECOMPUTE, loss_name="loss"), swap()])
    composed = manager(ir.from_proto(model))
    assert composed.modified
    composed = ir.to_proto(composed.model)
    assert composed.SerializeToString() == one_after_the_other.SerializeToString()
    ops = [n.op_type for n in composed.graph.node]
    assert ops.count("SwapOut") == ops.count("SwapIn") == 1 and len(ops) == len(model.graph.node) + clones + 2
    _assert_same_numbers(model, composed, feeds)


def test_a_pass_manager_of_split_and_swap_writes_what_they_write_one_after_the_other():
    model, feeds = _model(SPLIT_GRAPH), _split_feeds()
    infos = infos_for(model, feeds)
    plan = SplitPlan(SPLIT.runs[:1])
    split, micro_ops = write_split_plan(model, plan, infos)
    split_infos = infos_for(split, feeds)
    program = lower(split, split_infos, state_pairs={}, data_inputs=list(feeds), max_block_nodes=1)
    swap_plan = _out_and_back(program, split, "res", "sc")  # read by the run's micro-ops, then by the scatter

    def swap():
        return SwapPass(program, swap_plan, split_infos, budget=2**30)

    one_after_the_other = ir.to_proto(swap()(ir.from_proto(split)).model)
    composed = ir.to_proto(onnx_ir.passes.PassManager([SplitPass(plan, infos), swap()])(ir.from_proto(model)).model)
    assert composed.SerializeToString() == one_after_the_other.SerializeToString()
    assert [n.op_type for n in composed.graph.node if n.domain == DOMAIN] == ["SwapOut", "SwapIn"]
    assert micro_ops == 10 and len(composed.graph.node) > len(model.graph.node) + micro_ops
    _assert_same_numbers(model, composed, feeds)


def test_a_plan_is_written_by_its_rewrites_then_its_swaps_in_one_pass_manager_run():
    """:func:`apply_plan` starts from the planner's graph: the plan's recompute pass, then its
    swaps where the runtime issues them, equal to the swaps written into the plan's own graph."""
    from graph_passes.ir.memory import simulate_program
    from graph_passes.planning.apply import apply_plan
    from graph_passes.planning.choice import ProgramChoice
    from graph_passes.planning.driver import StepPlan
    from graph_passes.planning.swap.planner import apply_swap_plan, placed_plan

    model, feeds = _model(STEP), _step_feeds()
    recomputed, clones = write_recompute_plan(model, RECOMPUTE, loss_name="loss")
    infos = recomputed_infos(infos_for(model, feeds), recomputed)
    base = _step_program(recomputed, infos)
    swaps = _out_and_back(base, recomputed, "a1", "gw2")
    program = apply_swap_plan(base, swaps)
    choice = ProgramChoice(program, simulate_program(program, infos), ("recompute", "swap"), base, swaps)
    plan = StepPlan(infos, choice, recomputed, recomputed_nodes=clones,
                    rewrites=(RecomputePass(RECOMPUTE, loss_name="loss"),))
    applied = apply_plan(model, plan, budget=2**30)
    placed = placed_plan(swaps, program)
    assert applied.swap_plan == placed
    expected = SwapPass(base, placed, infos, budget=2**30)(ir.from_proto(recomputed)).model
    assert applied.model.SerializeToString() == ir.to_proto(expected).SerializeToString()
    assert listing(apply_plan(model, dataclasses.replace(plan, choice=ProgramChoice(base, choice.trace)),
                              budget=None).model) == listing(recomputed)
    _assert_same_numbers(model, applied.model, feeds)


def test_the_passes_contracts_hold_inside_a_pass_manager():
    """A swap plan made for the graph before recompute is not a lowering of the graph after it;
    the swap pass's ensures re-checks the budget in the memory simulator."""
    model = _model(STEP)
    infos = infos_for(model, _step_feeds())
    program = _step_program(model, infos)

    def run(*passes):
        with pytest.raises(onnx_ir.passes.PassError) as raised:
            onnx_ir.passes.PassManager(list(passes))(ir.from_proto(model))
        return raised.value.__cause__.__cause__  # the manager's step, then the pass that failed

    stale = run(RecomputePass(RECOMPUTE, loss_name="loss"), SwapPass(program, _swap_plan(), infos, budget=2**30))
    assert isinstance(stale, onnx_ir.passes.PreconditionError) and "not a lowering of this graph" in str(stale)
    over = run(SwapPass(program, _swap_plan(), infos, budget=1024))
    assert isinstance(over, onnx_ir.passes.PostconditionError) and "does not fit the budget 1024" in str(over)
