"""Block layouts of one graph: the graph lowered into execution blocks, cut where it must be.

A :class:`PlanningTarget` is what plans are made for (the graph as the runtime runs it, the
device's alignment, block size and profile); :class:`BlockLayouts` lowers it (or a rewrite of
it) for a signature's shapes into uniform block sizes, at chosen cuts, with the state updates
apart, or as the memory-aware partition, and replays each through the allocator. Every planner
starts from these layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import onnx

from graph_passes.cost.cost_model import AnalyticalCostModel, NodeTimesOnce
from graph_passes.cost.device_profiles import DeviceProfile
from graph_passes.cost.simulator import simulate_time
from graph_passes.ir.liveness import node_io
from graph_passes.ir.memory import MemoryTrace, simulate_program
from graph_passes.ir.program import Program, lower
from graph_passes.ir.training_graph import TrainingGraph
from graph_passes.planning.partition import fit_blocks
from graph_passes.planning.schedule import training_spine, updates_start

# Block sizes (nodes per block) tried below the whole graph, largest first.
AUTO_BLOCK_SIZES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
NODE_TIMES_KEPT = 24  # graphs whose node times a layouts object keeps: a search's graph and its recompute rewrites


def block_size_candidates(num_nodes: int, max_block_nodes: int | None) -> list[int]:
    """Block sizes to try for a graph: the device's fixed size, or the whole graph and then
    :data:`AUTO_BLOCK_SIZES` below it."""
    if max_block_nodes is not None:
        return [max_block_nodes]
    return [max(num_nodes, 1)] + [n for n in AUTO_BLOCK_SIZES if n < num_nodes]


@dataclasses.dataclass(frozen=True, eq=False)
class PlanningTarget:
    """What plans are made for: one graph as the runtime runs it, and the device's settings.

    ``model`` is the graph's model, or its standard-op form where it carries swap nodes
    (``swap_points`` then fixes where it swaps and the blocks cannot move). ``profile`` gives
    the device profile plans are timed on (a function: the CPU's is measured on first use)."""

    graph: TrainingGraph
    model: onnx.ModelProto
    profile: Callable[[], DeviceProfile]
    schedule: Sequence[int] | None = None
    swap_points: object = None
    fetches: Sequence[str] | None = None
    passes: tuple[str, ...] = ()
    alignment: int = 64
    max_block_nodes: int | None = None
    measure_splits: bool = False  # profile split candidates on this machine (the CPU device)
    # Plans run on ONNX Runtime's CPU kernels (the CPU device, whatever profile plans are timed
    # on): splits whose exactness depends on a kernel's order of sums are probed there.
    cpu_kernels: bool = False
    intra_op_threads: int = 0  # the block sessions' thread count (0: ONNX Runtime's default)
    recompute_policy: str = "input_aware"
    selective_recompute: bool = True
    plan_time: float = 0.0  # seconds of planning in all; what the grid leaves goes to the GA (0: grid only)
    updates_early: bool = True  # swap plans may move state updates into the backward
    plan_seed: int = 0
    plan_evaluations: int | None = None  # a cap on the GA's evaluations (None: time only)
    plan_workers: int | None = None  # processes timing the GA's genomes (None: the default)
    # Device memory each block's session holds while it exists (the CUDA EP's library
    # handles): a plan of N blocks has N of them less budget for its tensors.
    session_bytes: int = 0

    @property
    def blocks_fixed(self) -> bool:
        """Whether the block layout is given (the device's block size, or the graph's swap nodes)."""
        return self.max_block_nodes is not None or self.swap_points is not None


class BlockLayouts:
    """Lowerings of a target's graph (or of rewrites of it) into blocks, with per-model caches."""

    def __init__(self, target: PlanningTarget) -> None:
        self.target = target
        self._node_io_of: dict[int, tuple[onnx.ModelProto, list]] = {}  # id(model) -> (model, node_io)
        self._updates_cut_of: dict[int, tuple[onnx.ModelProto, int | None]] = {}  # id(model) -> (model, cut)
        self._memo: dict | None = None  # while memoized(): lowerings and replays by the ids of what made them
        self._node_times_of: dict[tuple, NodeTimesOnce] = {}  # (id(model), id(infos), profile) -> node times

    @contextlib.contextmanager
    def memoized(self):
        """Within: each lowering and replay is made once and reused (they depend on the model,
        infos, schedule and cuts, never on the budget: the least-budget search plans one
        signature at many budgets). Models and infos are not edited once made."""
        if self._memo is not None:
            yield
            return
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def _memoized(self, key: tuple, pinned: tuple, make: Callable[[], object]):
        """``make()``, or what it gave for ``key`` (ids of ``pinned``, held so the ids stay theirs)."""
        if self._memo is None:
            return make()
        entry = self._memo.get(key)
        if entry is None:
            entry = self._memo[key] = (pinned, make())
        return entry[1]

    def trace(self, program: Program, infos) -> MemoryTrace:
        """``program`` replayed through the arena's allocator; its peak and minimum budget
        include what its block sessions hold for themselves (``target.session_bytes`` each)."""
        trace = self._memoized(("trace", id(program), id(infos)), (program, infos),
                               lambda: simulate_program(program, infos, alignment=self.target.alignment))
        sessions = len(program.blocks) * self.target.session_bytes
        if not sessions:
            return trace
        return dataclasses.replace(trace, peak_device_bytes=trace.peak_device_bytes + sessions,
                                   min_budget_bytes=trace.min_budget_bytes + sessions)

    def lower_program(self, model: onnx.ModelProto, infos, schedule, *, max_block_nodes: int, extra_cuts=()) -> Program:
        """``model`` (this graph, or a rewrite of it) lowered for these shapes."""
        graph = self.target.graph

        def make() -> Program:
            return lower(
                model, infos, state_pairs=graph.state_pairs, data_inputs=graph.data_inputs,
                fetches=self.target.fetches, max_block_nodes=max_block_nodes, schedule=schedule,
                swap_points=self.target.swap_points, extra_cuts=extra_cuts, alignment=self.target.alignment,
                io=self.node_io_of(model),
            )

        key = ("lower", id(model), id(infos), None if schedule is None else tuple(schedule), max_block_nodes,
               tuple(extra_cuts))
        return self._memoized(key, (model, infos), make)

    def node_io_of(self, model: onnx.ModelProto):
        """The model's :func:`~graph_passes.ir.liveness.node_io`, read once per model. Keyed by
        identity (protobuf messages take no weak references), holding the model so its id stays
        unique; models are not edited once made (passes return new ones)."""
        entry = self._node_io_of.get(id(model))
        if entry is None or len(entry[1]) != len(model.graph.node):
            entry = self._node_io_of[id(model)] = (model, node_io(model.graph.node))
        return entry[1]

    def updates_cut(self, model: onnx.ModelProto, schedule) -> int | None:
        """The schedule position where ``model``'s state updates begin, if they trail its
        backward (:func:`graph_passes.planning.schedule.updates_start`); None where they do not,
        for a graph without gradients, or where the blocks are fixed. Read once per model."""
        if self.target.blocks_fixed:
            return None
        entry = self._updates_cut_of.get(id(model))
        if entry is None:
            graph = self.target.graph
            spine = training_spine(graph.roles, graph.state_pairs, [o.name for o in model.graph.output])
            cut = None if spine is None else updates_start(model, spine, graph.state_pairs.values(), schedule,
                                                          io=self.node_io_of(model))
            entry = self._updates_cut_of[id(model)] = (model, cut)
        return entry[1]

    def lower_updates_apart(self, model: onnx.ModelProto, infos, schedule) -> Program | None:
        """``model`` in its largest blocks with the state updates in a block of their own, or
        None where they do not trail the backward. Cut off, the new parameters and optimizer
        moments are allocated after the backward has freed its activations (docs/decisions.md)."""
        cut = self.updates_cut(model, schedule)
        return None if cut is None else self.lower_with_cuts(model, infos, schedule, (cut,))

    def lower_with_cuts(self, model: onnx.ModelProto, infos, schedule, cuts) -> Program:
        """``model`` in blocks cut only at these schedule positions (and around order-dependent
        nodes, which always get blocks of their own)."""
        return self.lower_program(model, infos, schedule, max_block_nodes=max(len(model.graph.node), 1),
                                  extra_cuts=cuts)

    def simulated_time(self, program: Program, infos, model: onnx.ModelProto, budget: int) -> float:
        """Step time of ``program`` simulated on the planning profile."""
        profile = self.target.profile()
        return simulate_time(program, infos, model=model, cost_model=self._node_times(model, infos, profile),
                             profile=profile, budget=budget, alignment=self.target.alignment).step_time_s

    def _node_times(self, model: onnx.ModelProto, infos, profile: DeviceProfile) -> NodeTimesOnce:
        """The analytical node times of ``model`` for ``infos``, kept for the last
        :data:`NODE_TIMES_KEPT` graphs timed (a search times one graph, or its recompute
        rewrites, thousands of times); each entry holds its model and infos, so ids stay theirs."""
        key = (id(model), id(infos), profile.name)
        entry = self._node_times_of.pop(key, None)
        if entry is None or entry.model is not model or entry.infos is not infos:
            entry = NodeTimesOnce(AnalyticalCostModel(profile), model, infos)
        self._node_times_of[key] = entry  # the most recent last
        while len(self._node_times_of) > NODE_TIMES_KEPT:
            del self._node_times_of[next(iter(self._node_times_of))]
        return entry

    def lowerings(self, model: onnx.ModelProto, infos, schedule):
        """``model`` lowered with each candidate block size, largest first (lazily)."""
        for block_nodes in block_size_candidates(len(model.graph.node), self.target.max_block_nodes):
            yield self.lower_program(model, infos, schedule, max_block_nodes=block_nodes)

    def fewest_fitting_blocks(self, model, infos, schedule, budget: int, *, max_blocks: int | None = None,
                              tried: list[Program] | None = None):
        """(program, trace) of ``model`` in its fewest blocks that fit ``budget``: the first
        uniform lowering that fits (largest blocks first), or the memory-aware partition where
        that has fewer blocks. None if nothing fits or, with ``max_blocks``, as soon as it is
        clear nothing fits in that many. ``tried`` collects the uniform lowerings checked."""
        for program in self.lowerings(model, infos, schedule):
            if max_blocks is not None and len(program.blocks) > max_blocks:
                return self.fitted_blocks(model, infos, schedule, budget, max_blocks=max_blocks)
            if tried is not None:
                tried.append(program)
            trace = self.trace(program, infos)
            if trace.min_budget_bytes <= budget:
                return self.fewest_blocks(model, infos, schedule, budget, program, trace)
        return None

    def fewest_blocks(self, model, infos, schedule, budget: int, program: Program, trace: MemoryTrace):
        """``program`` (a uniform lowering that fits ``budget``), or the memory-aware partition
        of the same graph (:func:`graph_passes.planning.partition.fit_blocks`) if it fits with
        fewer blocks."""
        refined = self.fitted_blocks(model, infos, schedule, budget)
        if refined is not None and len(refined[0].blocks) < len(program.blocks):
            return refined
        return program, trace

    def fitted_blocks(self, model, infos, schedule, budget: int, *, max_blocks: int | None = None):
        """(program, trace) of the memory-aware partition if it fits ``budget`` in at most
        ``max_blocks`` blocks; None if not, or where the block layout is fixed."""
        if self.target.blocks_fixed:
            return None
        order = list(schedule) if schedule is not None else list(range(len(model.graph.node)))
        position_of = {node: position for position, node in enumerate(order)}
        return fit_blocks(lambda cuts: self.lower_with_cuts(model, infos, schedule, cuts), infos, budget=budget,
                          position_of=position_of, alignment=self.target.alignment, max_blocks=max_blocks)
