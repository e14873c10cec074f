"""The execution provider: runs lowered training-step programs under the device budget.

:class:`Runtime` owns one device's arena, host store and statistics; :class:`GraphRunner`
runs one graph on it: per input signature it infers shapes, lowers the graph into blocks and
steps (:mod:`graph_passes.program`), replays the program through the arena's allocator
(:mod:`graph_passes.memory`) to check the budget before anything runs, then executes the steps
with one ONNX Runtime session per block bound into arena memory. The device's memory, copy
engines and providers come from its backend (:mod:`ort_offload.device_backend`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Mapping, Sequence

import numpy as np
import onnx

from graph_passes import shapes
from graph_passes.cost_model import AnalyticalCostModel
from graph_passes.device_profiles import DeviceProfile, get_profile
from graph_passes.liveness import node_io
from graph_passes.memory import MemoryTrace, align_up, allocation_units, simulate_program
from graph_passes.offload_choice import RATIOS, recompute_first, segment_costs
from graph_passes.partition import fit_blocks, refine_blocks
from graph_passes.program import (
    Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut, is_order_dependent, lower, order_dependent_last,
)
from graph_passes.recompute_pass import recomputed_infos
from graph_passes.split_pass import Cut, write_split_plan
from graph_passes.split_planner import Bottleneck, JointPlanner, split_node_count
from graph_passes.shapes import TensorInfo
from graph_passes.schedule import training_spine, updates_early, updates_start
from graph_passes.swap_nodes import canonicalize, has_swap_nodes
from graph_passes.simulator import simulate_time
from graph_passes.swap_planner import SwapPlan, blocks_over, required_bytes
from graph_passes.swap_search import STATE_NONE, SwapSearch
from graph_passes.training_graph import TrainingGraph
from ort_offload.arena import DeviceArena, OutOfArenaMemory, make_policy
from ort_offload.block_session import BlockSession, block_content_key, block_model, default_session_options
from ort_offload.budget import format_bytes
from ort_offload.device import OffloadDevice
from ort_offload.device_backend import DeviceBackend, make_backend
from ort_offload.device_memory import all_finite
from ort_offload.errors import BudgetTooSmallError, ExecutionError, OffloadError
from ort_offload.gc_pause import collection_paused
from ort_offload.host_slots import signature_values
from ort_offload.host_store import HostStore
from ort_offload.ort_logging import ort_error_summary
from ort_offload.recompute_planning import RecomputePlanning

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RuntimeStats:
    """What the runtime measured; feeds the report."""

    peak_device_bytes: int = 0  # arena extent + the running block's workspace, as the plan accounts it
    measured_device_bytes: int | None = None  # the device's own counter, less its fixed overhead (CUDA)
    plan_time_s: float = 0.0
    blocks_run: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_ins: int = 0  # planned swap-ins issued
    prefetch_hits: int = 0  # planned swap-ins whose copy had finished when the tensor was needed
    faults: int = 0  # tensors a step needed that were neither resident nor on their way
    fault_log: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (where, tensor)
    swap_time_s: float = 0.0  # compute stalled on copies: waits on swap-ins and on swap-outs to free room, faults
    plans_made: int = 0  # input signatures planned
    plan_cache_hits: int = 0  # prepares answered from the plan cache
    region_placements: int = 0  # allocations the arena policy steered (double buffering)
    region_fallbacks: int = 0  # ... of which could not go where it wanted (that half was full)


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A graph lowered and checked for one input signature."""

    signature: tuple
    infos: Mapping[str, TensorInfo]
    program: Program
    trace: MemoryTrace
    passes: tuple[str, ...] = ()  # passes this program applies
    base_program: Program | None = None  # the lowering the swap plan was made for
    swap_plan: SwapPlan | None = None
    model: onnx.ModelProto | None = None  # the graph the program runs (rewritten by recompute)
    recomputed_nodes: int = 0  # clone nodes the recompute pass added
    split_nodes: int = 0  # nodes the split pass added
    split_plan: object = None  # graph_passes.split_planner.JointPlan


class Runtime:
    """One device's memory (arena + host store) shared by every graph that runs on it."""

    def __init__(self, device: OffloadDevice, *, backend: DeviceBackend | None = None) -> None:
        """``backend``: the device's memory, copy engines and providers (default: the one
        ``device.kind`` names; tests pass :func:`~ort_offload.device_backend.stream_backend`)."""
        self.device = device
        self.backend = backend if backend is not None else make_backend(device)
        self.host = HostStore(self.backend.memory.host_empty)
        self.arena: DeviceArena | None = None
        self.budget_bytes: int | None = None if device.budget is None else device.budget.nbytes
        self.stats = RuntimeStats()
        self.copy_engine = self.backend.h2d  # swap-ins
        self.evict_engine = self.backend.d2h  # swap-outs
        self._planning_profile: DeviceProfile | None = None

    def planning_profile(self) -> DeviceProfile:
        """The profile plans are timed on: the device's ``planning_profile``, else this device
        itself (the CPU, measured once per machine and cached; a GPU by its name)."""
        if self._planning_profile is None:
            self._planning_profile = get_profile(self.device.planning_profile or self.backend.profile_name)
        return self._planning_profile

    def session_options(self, *, spinning: bool, serial: bool = False):
        """Options for a block session: ``spinning`` while it runs (it stops when the run
        returns); order-dependent blocks run on one thread so every run sums in the same order."""
        threads = 1 if serial else self.device.intra_op_threads
        # On a GPU the host only launches kernels: a spinning pool would take cores for nothing.
        return default_session_options(intra_op_threads=threads, spinning=spinning and self.device.kind == "cpu")

    def resolve_budget(self, baseline_peak_bytes: int) -> int | None:
        """Bytes of the budget; a fraction resolves against the first unplanned peak seen."""
        if self.budget_bytes is None and self.device.budget is not None:
            self.budget_bytes = self.device.budget.resolve(baseline_peak_bytes)
        return self.budget_bytes

    def place_state(
        self, state: Mapping[str, np.ndarray], order: Sequence[str], capacity: int, *, host: Sequence[str] = ()
    ) -> None:
        """Put the trainer's state into a fresh arena, packed in ``order``; ``host`` names
        state a swap plan keeps in the host store between steps."""
        # Without a budget the arena grows when it must; with one it compacts instead.
        with self.backend.on_compute_stream():
            self.arena = DeviceArena(capacity, alignment=self.device.alignment, growable=self.budget_bytes is None,
                                     memory=self.backend.memory)
            for name in order:
                self.arena.store(name, state[name])
        for name in host:
            self.host.put(name, state[name])

    def view(self, name: str) -> np.ndarray:
        """The tensor where it is now (arena memory or the host store; a host copy where the
        arena is device memory); do not keep it."""
        if name not in self.arena:
            return self.host.get(name)
        return self.arena.view(name) if self.arena.eager else self.read(name)

    def info(self, name: str) -> TensorInfo:
        if name in self.arena:
            return self.arena.info(name)
        array = self.host.get(name)
        return TensorInfo(np.dtype(array.dtype), tuple(array.shape))

    def read(self, name: str) -> np.ndarray:
        """A copy of a state tensor, wherever it lives."""
        if name not in self.arena:
            return self.host.get(name).copy()
        with self.backend.on_compute_stream():
            return self.arena.read(name)

    def first_nonfinite(self, names) -> str | None:
        """The first of ``names`` holding NaN or inf, else None; floating tensors in the arena
        are checked where they are (on a GPU, without copying them out)."""
        floating = [n for n in names if np.issubdtype(self.info(n).dtype, np.floating) and self.info(n).nbytes]
        resident = [n for n in floating if n in self.arena]
        with self.backend.on_compute_stream():
            finite = dict(zip(resident, self.arena.finite(resident)))
        for name in floating:
            ok = finite[name] if name in finite else all_finite(self.host.get(name))
            if not ok:
                return name
        return None

    def write(self, name: str, array: np.ndarray) -> None:
        """Overwrite a state tensor in place (same dtype and shape)."""
        info = self.info(name)
        if info.shape != tuple(array.shape) or info.dtype != array.dtype:
            raise ValueError(f"{name}: expected {info.dtype}{list(info.shape)}, got {array.dtype}{list(array.shape)}")
        if name not in self.arena:
            self.host.get(name)[...] = array
            return
        with self.backend.on_compute_stream():
            self.arena.write(name, array)


# Block sizes tried, largest first, when the device leaves the choice to the runtime: fewer,
# larger blocks run faster (ONNX Runtime fuses across more nodes, fewer calls); smaller ones
# free values sooner and bound each block's workspace.
AUTO_BLOCK_SIZES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)


def block_size_candidates(num_nodes: int, max_block_nodes: int | None) -> list[int]:
    """Block sizes to try for a graph: the device's fixed size, or the whole graph and then
    :data:`AUTO_BLOCK_SIZES` below it."""
    if max_block_nodes is not None:
        return [max_block_nodes]
    return [max(num_nodes, 1)] + [n for n in AUTO_BLOCK_SIZES if n < num_nodes]


class GraphRunner:
    """Runs one training-step (or forward) graph on a :class:`Runtime`."""

    def __init__(
        self, runtime: Runtime, graph: TrainingGraph, *, fetches: Sequence[str] | None = None, passes: Sequence[str] = ()
    ) -> None:
        self.runtime = runtime
        self.passes = tuple(passes)  # passes the runner may apply when the budget needs them
        # A graph that already carries swap nodes (from `ort-offload transform`) runs its own
        # swaps: the runner executes the standard nodes and turns the swap nodes into steps.
        self.swap_points = None
        self.model = graph.model
        if has_swap_nodes(graph.model):
            self.model, self.swap_points = canonicalize(graph.model)
            self.passes = ()
        # Order-dependent nodes run single-threaded in blocks of their own; scheduling them last
        # keeps everything before them in one block (swap nodes fix positions: keep the order).
        self.schedule = None if self.swap_points else order_dependent_last(self.model)
        self.graph = graph
        self.recompute = RecomputePlanning(self, policy=runtime.device.recompute_policy,
                                           selective=runtime.device.selective_recompute)
        self._node_io_of: dict[int, tuple[onnx.ModelProto, list]] = {}  # id(model) -> (model, node_io)
        self._updates_cut_of: dict[int, tuple[onnx.ModelProto, int | None]] = {}  # id(model) -> (model, cut)
        self.last_choice: list[tuple[str, float]] = []  # recompute-or-swap candidates: (what, simulated s)
        self.last_segment_costs: list = []  # graph_passes.offload_choice.SegmentCost of that choice
        self.fetches = fetches
        # Called as before_block(execution, block) once a block's inputs are resident, before it
        # runs (data-parallel training averages gradients there: ort_offload.distributed).
        self.before_block = None
        self._prepared: dict[tuple, PreparedStep] = {}
        self._sessions: dict[tuple[int, tuple[int, ...]], BlockSession] = {}  # (id(model), node indices)
        # The same sessions by what they run (block_content_key): a new recompute
        # plan's graph shares most blocks with earlier plans (the state updates' block, cut
        # off, is the same in every plan: 1,650 nodes of bert small, ~50 ms to create).
        self._sessions_by_content: dict[bytes, BlockSession] = {}
        self.sessions_shared = 0  # blocks of a new graph served by an existing session
        # Folded block inputs (device only): value per (signature, model, name), and the values
        # of each model that follow from the input shapes alone.
        self.host_value_cache: dict[tuple, np.ndarray] = {}
        self._signature_values: dict[int, tuple[onnx.ModelProto, frozenset[str]]] = {}
        self.baseline_peak_bytes: int | None = None
        self.last_trace: MemoryTrace | None = None
        self.last_prepared: PreparedStep | None = None
        self.baseline_trace: MemoryTrace | None = None  # the unplanned program's, for plots
        self.step_times_s: list[float] = []
        self.declared_inputs = shapes.declared_inputs(self.model)
        self.infer_infos = shapes.ShapeInference(self.model)  # per new signature

    # ---- planning --------------------------------------------------------------------------

    def prepare(self, input_infos: Mapping[str, TensorInfo], *, probe_feeds=None) -> PreparedStep:
        """Lower and check the graph for these input shapes (cached per signature).

        ``probe_feeds``: input values for shape probes, or a function returning them (called
        only when this signature is new)."""
        signature = tuple(sorted((n, i.dtype.str, i.shape) for n, i in input_infos.items()))
        prepared = self._prepared.get(signature)
        if prepared is not None:
            self.runtime.stats.plan_cache_hits += 1
            self.last_trace = prepared.trace
            self.last_prepared = prepared
            return prepared
        self.runtime.stats.plans_made += 1
        start = time.perf_counter()
        with collection_paused():
            prepared = self._prepare_signature(signature, input_infos, probe_feeds)
        self._prepared[signature] = prepared
        self.last_trace = prepared.trace
        self.last_prepared = prepared
        self.runtime.stats.plan_time_s += time.perf_counter() - start
        logger.info(
            "prepared %s: %d blocks, unplanned peak %s, this program's minimum budget %s",
            self.graph.name, len(prepared.program.blocks), format_bytes(self.baseline_peak_bytes),
            format_bytes(prepared.trace.min_budget_bytes),
        )
        return prepared

    def _prepare_signature(self, signature, input_infos: Mapping[str, TensorInfo], probe_feeds) -> PreparedStep:
        """What ``prepare`` does for a signature not seen before."""
        if callable(probe_feeds):
            probe_feeds = probe_feeds()
        infos = self.infer_infos(input_infos, probe_feeds=probe_feeds)
        budget = None
        needed = None
        chosen = None
        programs = []
        model, recomputed = self.model, 0
        updates_apart = False  # chosen: the largest blocks with the state updates cut off
        unrecomputed = None
        recompute_allowed = "recompute" in self.passes and bool(self.graph.loss_name)
        for program in self.lowerings(self.model, infos, self.schedule):
            programs.append(program)
            trace = simulate_program(program, infos, alignment=self.runtime.device.alignment)
            first = needed is None
            if first:  # the largest blocks: the unplanned program
                self.baseline_peak_bytes = trace.peak_device_bytes
                self.baseline_trace = trace
                budget = self.runtime.resolve_budget(trace.peak_device_bytes)
                unplanned_need = trace.min_budget_bytes
                apart = apart_trace = None
                has_cut = self.updates_cut(self.model, self.schedule) is not None
                # Nothing recomputed, in the largest blocks as recompute plans lower them.
                unrecomputed = None if has_cut else (program, trace)
                if budget is not None and unplanned_need > budget and has_cut:
                    # The state updates in a block of their own: one cut, nothing recomputed
                    # or swapped. Replayed where it may fit (it frees at most the new state's
                    # bytes) and while the estimator collects the need plans start from.
                    new_state = sum(infos[n].nbytes for n in self.graph.state_pairs.values() if n in infos)
                    if unplanned_need - new_state <= budget or (recompute_allowed and self.recompute.collecting):
                        apart = self.lower_updates_apart(self.model, infos, self.schedule)
                        apart_trace = simulate_program(apart, infos, alignment=self.runtime.device.alignment)
                        unplanned_need = min(unplanned_need, apart_trace.min_budget_bytes)
                        unrecomputed = (apart, apart_trace)
                if recompute_allowed and budget is not None:
                    # A recompute plan made for a similar input size, if this one needs it and it
                    # fits (Mimose's plan cache): no block-size search, no planning.
                    reused = self.recompute.reuse(infos, budget, unplanned_fits=unplanned_need <= budget)
                    if reused is not None:
                        needed = unplanned_need
                        model, infos, chosen, recomputed = reused
                        break
            needed = trace.min_budget_bytes if needed is None else min(needed, trace.min_budget_bytes)
            if budget is None or trace.min_budget_bytes <= budget:
                chosen = (program, trace, (), program, None)
                break
            if first and apart_trace is not None:
                needed = min(needed, apart_trace.min_budget_bytes)
                if apart_trace.min_budget_bytes <= budget:
                    chosen, updates_apart = (apart, apart_trace, (), apart, None), True
                    break
            if first and recompute_allowed:
                # Recompute in large blocks before smaller blocks without it: on this CPU every
                # cut costs more than the recomputation (README, "How it works", recompute).
                break
        if chosen is not None and not recomputed and not updates_apart and len(chosen[0].blocks) > len(programs[0].blocks):
            # Cut into N-node blocks everywhere it fits; cut only where memory is tight it may
            # fit with fewer, larger (faster) blocks.
            program, trace = self.fewest_blocks(self.model, infos, self.schedule, budget, chosen[0], chosen[1])
            chosen = (program, trace, (), program, None)
        if chosen is None and recompute_allowed and "swap" in self.passes:
            model, infos, chosen, recomputed, needed = self._choose_recompute_or_swap(infos, budget, needed)
        elif chosen is None and recompute_allowed:
            model, infos, programs, chosen, recomputed, needed = self.recompute.plan(infos, budget, programs, needed,
                                                                                     unrecomputed=unrecomputed)
        elif chosen is None and "swap" in self.passes:
            chosen, needed, _ = self._plan_swaps(programs, infos, budget, model)
        split_nodes, split_plan, bottleneck = 0, None, ""
        if chosen is None and "split" in self.passes and budget is not None and self.swap_points is None:
            # Swap and recompute alone cannot: split the ops that do not fit (TSPLIT), swap the rest.
            split = self._plan_split(input_infos, probe_feeds, infos, budget, needed)
            if isinstance(split, Bottleneck):
                # The minimum stated stays the one that plans without splits: the walk stops at
                # the first op no split fits, so it cannot say what a split plan would need.
                where = f"{split.op_type} {split.node!r}" if split.node else "a load or fetch"
                bottleneck = f" (splitting stops at {where}: {split.reason})"
            else:
                model, infos, chosen, split_nodes, split_plan = split
                recomputed = 0
        if chosen is None:
            offered = [{"recompute": "recompute", "swap": "swapping", "split": "splitting"}[p]
                       for p in ("recompute", "swap", "split") if p in self.passes]
            how = f"with {' and '.join(offered)}" if offered else "without offload passes (try --passes auto)"
            raise BudgetTooSmallError(
                f"budget {format_bytes(budget)} is below the {format_bytes(needed)} ({needed} bytes) "
                f"{self.graph.name} needs {how}; raise the budget to at least that{bottleneck}",
                needed_bytes=needed,
                budget_bytes=budget,
            )
        if recompute_allowed and budget is not None:
            self.recompute.observe(infos, unplanned_need)
        program, trace, applied, base, plan = chosen
        return PreparedStep(signature, infos, program, trace, applied, base, plan, model=model,
                            recomputed_nodes=recomputed, split_nodes=split_nodes, split_plan=split_plan)

    def lower_program(self, model: onnx.ModelProto, infos, schedule, *, max_block_nodes: int, extra_cuts=()) -> Program:
        """``model`` (this graph, or a rewrite of it) lowered for these shapes."""
        return lower(
            model, infos, state_pairs=self.graph.state_pairs, data_inputs=self.graph.data_inputs,
            fetches=self.fetches, max_block_nodes=max_block_nodes, schedule=schedule, swap_points=self.swap_points,
            extra_cuts=extra_cuts, alignment=self.runtime.device.alignment, io=self.node_io_of(model),
        )

    def node_io_of(self, model: onnx.ModelProto):
        """The model's :func:`~graph_passes.liveness.node_io`, read once per model: a plan's
        graph is lowered at every new size and for every block layout tried. Keyed by identity
        (protobuf messages take no weak references), holding the model so its id stays unique;
        the runner's models are not edited once made (passes return new ones)."""
        entry = self._node_io_of.get(id(model))
        if entry is None or len(entry[1]) != len(model.graph.node):
            entry = self._node_io_of[id(model)] = (model, node_io(model.graph.node))
        return entry[1]

    def updates_cut(self, model: onnx.ModelProto, schedule) -> int | None:
        """The schedule position where ``model``'s state updates begin, if they trail its
        backward (:func:`graph_passes.schedule.updates_start`); None where they do not, for a
        graph without gradients, or where the blocks are fixed (by the device's block size or
        the graph's swap nodes). Read once per model, as :meth:`node_io_of`."""
        if self.runtime.device.max_block_nodes is not None or self.swap_points is not None:
            return None
        entry = self._updates_cut_of.get(id(model))
        if entry is None:
            spine = training_spine(self.graph.roles, self.graph.state_pairs, [o.name for o in model.graph.output])
            cut = None if spine is None else updates_start(model, spine, self.graph.state_pairs.values(), schedule,
                                                          io=self.node_io_of(model))
            entry = self._updates_cut_of[id(model)] = (model, cut)
        return entry[1]

    def lower_updates_apart(self, model: onnx.ModelProto, infos, schedule) -> Program | None:
        """``model`` in its largest blocks with the state updates in a block of their own, or
        None where they do not trail the backward. A block's outputs are allocated when it
        starts: with the updates in the backward's block, the new parameters and optimizer
        moments take arena room while every activation is live; cut off, they are allocated
        after the backward has freed them. BERT small: ~27 MiB less at any length (the
        parameters and both AdamW moments, less the gradients the cut passes on), and no
        measurable step time once both large blocks spin (see :meth:`session`); a budgeted
        plan tries it before recomputing anything and plans recomputation on it."""
        cut = self.updates_cut(model, schedule)
        return None if cut is None else self.lower_with_cuts(model, infos, schedule, (cut,))

    def lower_with_cuts(self, model: onnx.ModelProto, infos, schedule, cuts) -> Program:
        """``model`` in blocks cut only at these schedule positions (and around order-dependent
        nodes, which always get blocks of their own)."""
        return self.lower_program(model, infos, schedule, max_block_nodes=max(len(model.graph.node), 1),
                                  extra_cuts=cuts)

    def simulated_time(self, program: Program, infos, model: onnx.ModelProto, budget: int) -> float:
        """Step time of ``program`` simulated on the planning profile."""
        profile = self.runtime.planning_profile()
        return simulate_time(program, infos, model=model, cost_model=AnalyticalCostModel(profile), profile=profile,
                             budget=budget, alignment=self.runtime.device.alignment).step_time_s

    def lowerings(self, model: onnx.ModelProto, infos, schedule):
        """``model`` lowered with each candidate block size, largest first (lazily)."""
        for block_nodes in block_size_candidates(len(model.graph.node), self.runtime.device.max_block_nodes):
            yield self.lower_program(model, infos, schedule, max_block_nodes=block_nodes)

    def fewest_fitting_blocks(self, model, infos, schedule, budget: int, *, max_blocks: int | None = None,
                              tried: list[Program] | None = None):
        """(program, trace) of ``model`` in its fewest blocks that fit ``budget``: the first
        uniform lowering that fits (largest blocks first), or the memory-aware partition where
        that has fewer blocks. None if nothing fits or, with ``max_blocks``, as soon as it is
        clear nothing fits in that many (uniform lowerings only get finer, and the partition
        stops past it). ``tried`` collects the uniform lowerings checked."""
        for program in self.lowerings(model, infos, schedule):
            if max_blocks is not None and len(program.blocks) > max_blocks:
                return self.fitted_blocks(model, infos, schedule, budget, max_blocks=max_blocks)
            if tried is not None:
                tried.append(program)
            trace = simulate_program(program, infos, alignment=self.runtime.device.alignment)
            if trace.min_budget_bytes <= budget:
                return self.fewest_blocks(model, infos, schedule, budget, program, trace)
        return None

    def fewest_blocks(self, model, infos, schedule, budget: int, program: Program, trace: MemoryTrace):
        """``program`` (a uniform lowering that fits ``budget``), or a memory-aware partition
        of the same graph (:func:`graph_passes.partition.fit_blocks`) if it fits with fewer
        blocks."""
        refined = self.fitted_blocks(model, infos, schedule, budget)
        if refined is not None and len(refined[0].blocks) < len(program.blocks):
            return refined
        return program, trace

    def fitted_blocks(self, model, infos, schedule, budget: int, *, max_blocks: int | None = None):
        """(program, trace) of the memory-aware partition (:func:`graph_passes.partition.fit_blocks`)
        if it fits ``budget`` in at most ``max_blocks`` blocks; None if not, or where the block
        size is fixed (by the user, or by the graph's swap nodes)."""
        if self.runtime.device.max_block_nodes is not None or self.swap_points is not None:
            return None
        order = list(schedule) if schedule is not None else list(range(len(model.graph.node)))
        position_of = {node: position for position, node in enumerate(order)}
        return fit_blocks(lambda cuts: self.lower_with_cuts(model, infos, schedule, cuts), infos, budget=budget,
                          position_of=position_of, alignment=self.runtime.device.alignment, max_blocks=max_blocks)

    def _choose_recompute_or_swap(self, infos, budget: int, needed: int):
        """Where recompute and swap are both allowed: plan recompute alone
        (or as far as it goes, then swap), swap alone, and the segments cheaper to recompute
        than to copy (:mod:`graph_passes.offload_choice`) recomputed with the rest swapped; the
        fastest in simulation on the planning profile wins. Returns (model, infos, chosen or
        None, clone count, least budget); ``self.last_choice`` lists the candidates."""
        profile = self.runtime.planning_profile()
        candidates = []  # (label, simulated seconds, model, infos, chosen, clones)

        def with_swaps(label, model, model_infos, programs, clones):
            nonlocal needed
            swapped, least, seconds = self._plan_swaps(programs, model_infos, budget, model)
            needed = min(needed, least)
            if swapped is not None:
                applied = ("recompute", "swap") if clones else ("swap",)
                candidates.append((label, seconds, model, model_infos, (*swapped[:2], applied, *swapped[3:]), clones))

        r_model, r_infos, r_programs, r_chosen, r_clones, least = self.recompute.plan(infos, budget, [], needed)
        needed = min(needed, least)
        if r_chosen is not None:
            seconds = self.simulated_time(r_chosen[0], r_infos, r_model, budget)
            candidates.append(("recompute", seconds, r_model, r_infos, r_chosen, r_clones))
        else:
            with_swaps("recompute all, swap the rest", r_model, r_infos, r_programs, r_clones)
        with_swaps("swap", self.model, infos, list(self.lowerings(self.model, infos, self.schedule)), 0)
        segments = self.recompute.segments(infos)
        costs = segment_costs(segments, self.model, infos, cost_model=AnalyticalCostModel(profile), profile=profile)
        saving = len([s for s in segments if s.saved_bytes > 0])
        for cheap in dict.fromkeys(recompute_first(costs, ratio) for ratio in RATIOS):
            if cheap and len(cheap) < saving:
                m_model, m_schedule, m_clones = self.recompute.rewrite(cheap, segments)
                m_infos = recomputed_infos(infos, m_model)
                with_swaps(f"recompute {len(cheap)} cheaper segments, swap the rest", m_model, m_infos,
                           list(self.lowerings(m_model, m_infos, m_schedule)), m_clones)
        self.last_choice = [(label, seconds) for label, seconds, *_ in candidates]
        self.last_segment_costs = costs
        if not candidates:
            return self.model, infos, None, 0, needed
        label, seconds, model, model_infos, chosen, clones = min(candidates, key=lambda c: c[1])
        if label != "recompute":
            self.recompute.forget(infos)  # the recompute plan was not taken: no reuse of it
        logger.info("recompute or swap for %s on %s: %s (%s)", self.graph.name, profile.name, label,
                    ", ".join(f"{name}: {t * 1e3:.2f} ms" for name, t in self.last_choice))
        return model, model_infos, chosen, clones, needed

    def _plan_split(self, input_infos, probe_feeds, infos, budget: int, needed: int):
        """Split the ops too large for the budget (:class:`graph_passes.split_planner.JointPlanner`),
        then plan swaps on the split graph (or, without the swap pass, the lowering that fits).
        Returns (model, infos, chosen, split node count, JointPlan), or the Bottleneck."""
        profile = self.runtime.planning_profile()

        def lower_fine(model, model_infos):
            return self.lower_program(model, model_infos, order_dependent_last(model), max_block_nodes=1)

        def infer(model):
            return shapes.infer_tensor_infos(model, input_infos, probe_feeds=probe_feeds)

        # Planning for the machine the step runs on: the op and its micro-ops are profiled here
        # (Eq. 6 from measured kernels); for another device's profile, the roofline estimates.
        measure = self.runtime.device.kind == "cpu" and self.runtime.device.planning_profile is None
        planner = JointPlanner(lower=lower_fine, infer=infer, cost_model=AnalyticalCostModel(profile),
                               alignment=self.runtime.device.alignment, measure=measure)
        result = planner.plan(self.model, infos, budget)
        if isinstance(result, Bottleneck):
            logger.info("split plan for %s: bottleneck %s %s needs %d bytes (%s)", self.graph.name, result.op_type,
                        result.node, result.needed_bytes, result.reason)
            return result
        model, _ = write_split_plan(self.model, result.split, infos, cut=Cut.SPLIT)
        split_infos = infer(model)
        schedule = order_dependent_last(model)
        programs = list(self.lowerings(model, split_infos, schedule))
        chosen = None
        if "swap" in self.passes:
            chosen, least, _ = self._plan_swaps(programs, split_infos, budget, model)
        else:
            for program in programs:
                trace = simulate_program(program, split_infos, alignment=self.runtime.device.alignment)
                if trace.min_budget_bytes <= budget:
                    chosen = (program, trace, (), program, None)
                    break
        if chosen is None:
            return Bottleneck("", "", budget + 1, "the split graph has no program within the budget"
                              + ("" if "swap" in self.passes else " without swapping"))
        chosen = (chosen[0], chosen[1], ("split", *chosen[2]), *chosen[3:])
        logger.info("split plan for %s: %d ops split, %d nodes added", self.graph.name, len(result.choices),
                    split_node_count(model))
        return model, split_infos, chosen, split_node_count(model), result

    def _plan_swaps(self, programs, infos, budget: int, model: onnx.ModelProto):
        """The fastest swap plan within ``budget`` over the lowered ``programs`` (simulated on
        the device's planning profile), the least budget any of them needs, and the plan's
        simulated step time; (None, least budget, None) if none fits.

        Where copies overlap compute, the same graph is also planned with its state updates
        run as soon as their gradients exist (:func:`graph_passes.schedule.updates_early`:
        the optimizer's compute then hides the backward's swap-ins), and the faster of the two
        schedules wins."""
        profile = self.runtime.planning_profile()
        best, needed = self._plan_swaps_for(programs, infos, budget, model, order_dependent_last(model))
        if profile.copies_overlap_compute and self.swap_points is None:
            best, needed = self._plan_updates_early(programs, infos, budget, model, best, needed)
        if best is None:
            return None, needed, None
        return best[0], needed, best[1]

    def _plan_updates_early(self, programs, infos, budget: int, model: onnx.ModelProto, best, needed: int):
        """``best`` ((chosen, seconds) or None) against the plan of the same graph with its
        state updates early; the faster, and the least budget of both."""
        base = [i for block in programs[0].blocks for i in block.node_indices]
        spine = training_spine(self.graph.roles, self.graph.state_pairs, [o.name for o in model.graph.output])
        early = updates_early(model, spine, base) if spine is not None else None
        if early is not None:
            early_programs = list(self.lowerings(model, infos, early))
            other, other_needed = self._plan_swaps_for(early_programs, infos, budget, model, early)
            needed = min(needed, other_needed)
            if other is not None and (best is None or other[1] < best[1]):
                logger.info("swap plan for %s: state updates early (%.3g s simulated) over the given order (%s)",
                            self.graph.name, other[1], "none fits" if best is None else f"{best[1]:.3g} s")
                best = other
        return best, needed

    def _plan_swaps_for(self, programs, infos, budget: int, model: onnx.ModelProto, schedule):
        """:meth:`_plan_swaps` for one schedule (``programs``: lowerings of it): ((chosen,
        seconds) or None, least budget)."""
        alignment = self.runtime.device.alignment
        sizes = {n: align_up(i.nbytes, alignment) for n, i in infos.items()}
        needed = min(required_bytes(program, sizes) for program in programs)
        if needed <= budget and self.runtime.device.max_block_nodes is None and self.swap_points is None:
            # Besides N-node blocks everywhere: blocks cut only where one alone would not fit.
            order = list(schedule) if schedule is not None else list(range(len(model.graph.node)))

            refined = refine_blocks(lambda cuts: self.lower_with_cuts(model, infos, schedule, cuts), lambda p: (blocks_over(p, sizes, budget), None),
                                    position_of={node: k for k, node in enumerate(order)})
            if refined is not None and all(len(refined[0].blocks) < len(p.blocks) for p in programs
                                           if required_bytes(p, sizes) <= budget):
                programs = [refined[0], *programs]
        profile = self.runtime.planning_profile()

        def step_time(program: Program) -> float:
            return self.simulated_time(program, infos, model, budget)

        if profile.copies_overlap_compute:
            # Smaller blocks let copies start sooner: go on down the block sizes while they
            # keep getting faster.
            search = SwapSearch(while_improving=True)
        else:
            # Copies cost the compute's own cores whenever they run (the CPU device): nothing to
            # overlap, so Belady's own plan, with evictions where memory needs them, measured
            # fastest here (benchmarks/swap.py); only the block size is searched.
            search = SwapSearch(state_placements=(STATE_NONE,), early_swap_outs=False)
        result = search.search(programs, infos, budget=budget, evaluate=step_time, alignment=alignment)
        if result is None:
            return None, needed
        best = result.best
        logger.info(
            "swap plan for %s on %s: %d blocks, state on host %r, %d swaps, %s out / %s in per step",
            self.graph.name, profile.name, len(best.base_program.blocks), best.state_placement, best.plan.swap_count,
            format_bytes(best.plan.swap_out_bytes), format_bytes(best.plan.swap_in_bytes),
        )
        return ((best.program, best.trace, ("swap",), best.base_program, best.plan), best.step_time_s), needed

    def prepared_steps(self) -> list[PreparedStep]:
        """Every program prepared so far (one per input signature)."""
        return list(self._prepared.values())

    def capacity_for(self, prepared: PreparedStep) -> int:
        """Arena bytes for this program: the budget less the largest block workspace."""
        budget = self.runtime.budget_bytes
        if budget is None:
            return max(prepared.trace.arena_high_water, self.runtime.arena.high_water if self.runtime.arena else 0, 1)
        return budget  # each block then caps the arena at the budget less its own workspace

    # ---- execution -------------------------------------------------------------------------

    def session(self, prepared: PreparedStep, block_index: int) -> BlockSession:
        block = prepared.program.blocks[block_index]
        model = prepared.model if prepared.model is not None else self.model
        key = (id(model), block.node_indices)
        session = self._sessions.get(key)
        if session is None:
            elem_types = {n: onnx.helper.np_dtype_to_tensor_dtype(prepared.infos[n].dtype) for n in block.inputs + block.outputs}
            # Every block of more than one node spins while it runs, and stops when it returns
            # (default_session_options): a pool that sleeps between nodes pays a wake-up per
            # parallel node (the 1,650 optimizer nodes of bert small, cut off from the backward:
            # ~25 ms a step), and a pool still spinning after its block steals the next one's cores.
            serial = any(is_order_dependent(model.graph.node[i]) for i in block.node_indices)
            sub = block_model(model, block, elem_types)
            content = block_content_key(sub)  # the options below follow from the nodes alone
            session = self._sessions_by_content.get(content)
            if session is None:
                session = BlockSession(
                    model, block, elem_types,
                    session_options=self.runtime.session_options(spinning=len(block.node_indices) > 1 and not serial,
                                                                 serial=serial),
                    providers=self.runtime.backend.providers, sub=sub,
                    fold_host_inputs=not self.runtime.backend.memory_is_host,
                )
                self._sessions_by_content[content] = session
            else:
                self.sessions_shared += 1
            self._sessions[key] = session
        return session

    def signature_values(self, prepared: PreparedStep) -> frozenset[str]:
        """Values of ``prepared``'s graph equal in every step of its signature."""
        model = prepared.model if prepared.model is not None else self.model
        entry = self._signature_values.get(id(model))
        if entry is None:
            entry = self._signature_values[id(model)] = (model, signature_values(model))
        return entry[1]

    def run(self, feeds: Mapping[str, np.ndarray], prepared: PreparedStep) -> dict[str, np.ndarray]:
        """Execute one step with batch tensors ``feeds``; returns the fetched outputs."""
        with self.runtime.backend.on_compute_stream():  # device allocations and copies in stream order
            return self._run(feeds, prepared)

    def _run(self, feeds: Mapping[str, np.ndarray], prepared: PreparedStep) -> dict[str, np.ndarray]:
        runtime = self.runtime
        arena = runtime.arena
        arena.set_capacity(max(self.capacity_for(prepared), arena.allocator.high_water_live()))
        if not arena.eager:
            arena.reserve(prepared.trace.arena_high_water)
        started = time.perf_counter()
        execution = _StepExecution(self, prepared, feeds)
        handlers = {
            Load: execution.load, RunBlock: execution.run_block, Fetch: execution.fetch, Commit: execution.commit,
            SwapOut: execution.swap_out, SwapIn: execution.swap_in,
        }
        try:
            for step in prepared.program.steps:
                handlers[type(step)](step)
            execution.finish()
        except OutOfArenaMemory as e:
            execution.finish()
            self._abort(prepared.program, cause=e)
            raise BudgetTooSmallError(
                f"arena full while running {self.graph.name}: {e}; raise the budget",
                needed_bytes=arena.in_use + e.nbytes, budget_bytes=runtime.budget_bytes or 0,
            ) from e
        except Exception as e:
            execution.finish()
            self._abort(prepared.program, cause=e)
            raise
        runtime.stats.blocks_run += len(prepared.program.blocks)
        runtime.stats.peak_device_bytes = max(runtime.stats.peak_device_bytes, execution.peak)
        self.step_times_s.append(time.perf_counter() - started)
        if runtime.backend.used_bytes is not None:  # the device's counter: its arenas keep their high water
            measured = runtime.backend.used_bytes()
            runtime.stats.measured_device_bytes = max(runtime.stats.measured_device_bytes or 0, measured)
        return execution.fetched

    def _abort(self, program: Program, *, cause: BaseException) -> None:
        """Free a failed step's temporaries; fail loudly (naming ``cause``) if state was
        already consumed."""
        arena, host = self.runtime.arena, self.runtime.host
        state = set(program.state_inputs) | set(program.host_state)
        for name in arena.names():
            if name not in state:
                arena.free(name)
        for name in host.names():
            if name not in state:
                host.discard(name)
        lost = [n for n in sorted(state) if n not in arena and n not in host]
        if lost:
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise OffloadError(
                f"the step failed ({type(cause).__name__}: {first}) after it had consumed state "
                f"({', '.join(lost[:3])}...); reload the trainer from its last checkpoint"
            ) from cause


class _StepExecution:
    """The meaning of each program step for one run (one handler per step type)."""

    def __init__(self, runner: GraphRunner, prepared: PreparedStep, feeds: Mapping[str, np.ndarray]) -> None:
        self.runner = runner
        self.runtime = runner.runtime
        self.arena = runner.runtime.arena
        self.host = runner.runtime.host
        self.stats = runner.runtime.stats
        self.prepared = prepared
        self.infos = prepared.infos
        self.feeds = feeds
        self.fetched: dict[str, np.ndarray] = {}
        self.peak = self.arena.allocator.high_water_live()  # arena extent + running workspace
        self.budget = runner.runtime.budget_bytes
        self.drop_prefetches = runner.runtime.device.drop_prefetches
        self.copies = runner.runtime.copy_engine
        self.evictions = runner.runtime.evict_engine
        self.async_swap_outs = runner.runtime.device.swap_outs_are_async
        # Placement: which part of the arena each block's tensors go to (ort_offload.arena).
        usable = None if self.budget is None else self.budget - prepared.program.max_workspace_bytes
        self.policy = make_policy(runner.runtime.device.arena_policy, usable=usable, alignment=self.arena.alignment)
        self.first_reader = _first_readers(prepared.program) if self.policy.region(0) is not None else {}
        self.view_start = {whole: pieces[0] for whole, pieces in prepared.program.views}  # where a view is written
        self.block: int | None = None  # the block running or about to run
        # Swap-outs in flight: name -> the host buffer being filled. Their arena bytes stay
        # allocated until the copy is done and :meth:`_release` frees them.
        self.leaving: dict[str, np.ndarray] = {}
        # Compaction moves bytes: no copy may be reading or writing arena memory while it does.
        self.arena.before_move = self._drain

    def _drain(self) -> None:
        """Every copy finished (swap-outs are released later, by :meth:`_reap`)."""
        self.stats.swap_time_s += self.copies.drain() + self.evictions.settle()

    def finish(self) -> None:
        """End of the step (or of a failed one): every copy done and released, no hook left behind."""
        self._drain()
        self._reap()
        self.arena.before_move = None

    # ---- swap-outs in flight -----------------------------------------------------------

    def _release(self, name: str) -> None:
        """Wait for ``name``'s swap-out, keep its host copy and give its arena bytes back."""
        self.stats.swap_time_s += self.evictions.wait(name)[0]
        self.host.adopt(name, self.leaving.pop(name))
        self.arena.free(name)

    def _reap(self) -> None:
        """Release every swap-out that has finished."""
        for name in list(self.leaving):
            if self.evictions.done(name):
                self._release(name)

    def _with_room(self, action) -> None:
        """Run ``action`` (an allocation or a cap); while the arena is full, release the oldest
        swap-out in flight (waiting for its copy) and try again."""
        self._reap()
        while True:
            try:
                return action()
            except OutOfArenaMemory:
                if not self.leaving:
                    raise
                self._release(next(iter(self.leaving)))

    def _allocate(self, name: str, block: int | None) -> None:
        """Allocate ``name`` for ``block`` (where the policy wants it, room permitting)."""
        region = self.policy.region(block)
        self._with_room(lambda: self.arena.allocate(name, self.infos[name], region=region))
        if region is not None:
            self.stats.region_placements += 1
            offset = self.arena.allocator.placement(name).offset
            if not region[0] <= offset < region[1]:
                self.stats.region_fallbacks += 1

    def _allocate_view(self, name: str, pieces, block: int) -> None:
        """Allocate split view ``name`` as its pieces, back to back."""
        region = self.policy.region(block)
        parts = [(p, self.infos[p]) for p in pieces]
        self._with_room(lambda: self.arena.allocate_view(name, self.infos[name], parts, region=region))

    def _cap(self, workspace: int) -> None:
        if self.budget is not None:
            self._with_room(lambda: self.arena.limit(self.budget - workspace))

    def _measure(self, workspace: int) -> None:
        self.peak = max(self.peak, self.arena.allocator.high_water_live() + workspace)

    def load(self, step: Load) -> None:
        self._cap(0)
        self._allocate(step.name, self.first_reader.get(id(step)))
        self.arena.write(step.name, self.feeds[step.name])
        self._measure(0)

    def _ensure_resident(self, names, where: str) -> None:
        """Wait for inputs still being copied in; the tensor-fault handler fetches a needed
        tensor neither resident nor arriving from the host now, and counts and logs the fault."""
        for name in names:
            if name in self.leaving:  # on its way out (a plan would have swapped it back in)
                self._release(name)
            if self.copies.in_flight(name):
                waited, arrived = self.copies.consume(name)
                self.stats.swap_time_s += waited
                self.stats.prefetch_hits += arrived
            elif name not in self.arena:
                if name not in self.host:
                    raise ExecutionError(f"{where} needs {name!r}, which is neither in the arena nor on the host")
                self.stats.faults += 1
                self.stats.fault_log.append((where, name))
                self._copy_in(name)

    def current_values(self, names) -> dict[str, np.ndarray]:
        """Each of ``names`` where its value lives now, to be updated in place: its arena
        memory, else its host copy (every copy in flight finishes first). The host copy of a
        resident tensor is dropped: it would go stale, and a later swap-out copies again."""
        self._drain()
        values = {}
        for name in names:
            if name in self.leaving:
                self._release(name)
            if name in self.arena:
                self.host.discard(name)
                values[name] = self.arena.view(name)
            elif name in self.host:
                values[name] = self.host.get(name)
            else:
                raise ExecutionError(f"{name!r} is neither in the arena nor on the host")
        return values

    def _copy_in(self, name: str) -> None:
        started = time.perf_counter()
        self._allocate(name, self.block)
        self.arena.write(name, self.host.get(name))
        self.stats.swap_in_bytes += self.infos[name].nbytes
        self.stats.swap_time_s += time.perf_counter() - started

    def run_block(self, step: RunBlock) -> None:
        arena = self.arena
        session = self.runner.session(self.prepared, step.block)
        # This signature's block: the session may have been made at another one, whose
        # workspace (shape-dependent) is not this step's.
        block = self.prepared.program.blocks[step.block]
        workspace = block.workspace_bytes
        self.block = step.block
        self._cap(workspace)
        self._ensure_resident(block.inputs, f"block {step.block}")
        if self.runner.before_block is not None:
            self.runner.before_block(self, step.block)
        for name, pieces in allocation_units(self.prepared.program, step.allocates):
            if pieces:
                self._allocate_view(name, pieces, step.block)
            else:
                self._allocate(name, step.block)
        self._measure(workspace)
        pointers = {n: arena.pointer(self.view_start.get(n, n)) for n in block.inputs + block.outputs}
        try:
            session.run(pointers, self.infos, self.runtime.backend, self._host_values(session))
        except Exception as e:
            first = ort_error_summary(e)
            raise ExecutionError(
                f"block {step.block} of {self.runner.graph.name} failed in ONNX Runtime ({first}); "
                "check the batch values (e.g. token ids below the vocabulary size)"
            ) from e
        for name in step.frees:
            arena.free(name)
            self.host.discard(name)  # a clean host copy dies with the value

    def _host_values(self, session: BlockSession) -> dict[str, np.ndarray]:
        """Values of the block inputs its session folds (shapes a device's kernels read on
        the host): read from the arena, once per signature where they follow from the input
        shapes alone, else at every run."""
        values = {}
        for name in session.host_inputs:
            key = (self.prepared.signature, id(self.prepared.model), name)
            value = self.runner.host_value_cache.get(key)
            if value is None:
                value = self.arena.read(name)
                if name in self.runner.signature_values(self.prepared):
                    self.runner.host_value_cache[key] = value
            values[name] = value
        return values

    def fetch(self, step: Fetch) -> None:
        self._ensure_resident([step.name], f"fetch {step.name}")
        self.fetched[step.name] = self.arena.read(step.name)
        if step.free:
            self.arena.free(step.name)
            self.host.discard(step.name)

    def swap_out(self, step: SwapOut) -> None:
        name = step.name
        if name not in self.arena or name in self.leaving:  # out already (another signature's plan)
            return
        if self.copies.in_flight(name):
            self.stats.swap_time_s += self.copies.wait(name)[0]
        if step.copy or name not in self.host:
            target = self.runtime.backend.memory.host_empty(self.arena.info(name))
            copy = self.arena.downloader(name, target)
            self.stats.swap_out_bytes += self.infos[name].nbytes
            if self.async_swap_outs:  # on the device→host engine; the bytes are freed when done
                self.leaving[name] = target
                self.evictions.submit(name, copy)
                return
            started = time.perf_counter()
            copy()
            self.runtime.backend.synchronize()
            self.host.adopt(name, target)
            self.stats.swap_time_s += time.perf_counter() - started
        self.arena.free(name)  # copied, or the host copy was current: a drop

    def swap_in(self, step: SwapIn) -> None:
        if self.drop_prefetches:  # test mode: leave it to the fault handler
            return
        name = step.name
        if name in self.leaving:  # still being copied out: wait, then bring it back
            self._release(name)
        if name not in self.arena:  # resident already if another signature's plan kept it
            self._cap(0)
            self._allocate(name, self.first_reader.get(id(step)))  # bytes reserved at issue
            self.copies.submit(name, self.arena.uploader(name, self.host.get(name)))
            self.stats.swap_ins += 1
            self.stats.swap_in_bytes += self.infos[name].nbytes
            self._measure(0)

    def commit(self, step: Commit) -> None:
        self._drain()
        self._reap()
        for updated, state in step.renames:
            if state in self.arena:
                self.arena.free(state)
            self.host.discard(state)  # the old value's host copy is stale now
            if updated in self.arena:
                self.arena.rename(updated, state)
                if updated in self.host:
                    self.host.rename(updated, state)  # a clean copy stays clean under the new name
            else:
                self.host.rename(updated, state)


def _first_readers(program: Program) -> dict[int, int]:
    """For each ``Load``/``SwapIn`` step (by ``id``): the first block after it that reads its
    tensor — the execution block it is brought in for."""
    readers: dict[int, int] = {}
    next_reader: dict[str, int] = {}
    for step in reversed(program.steps):
        if isinstance(step, RunBlock):
            for name in program.blocks[step.block].inputs:
                next_reader[name] = step.block
        elif isinstance(step, (Load, SwapIn)) and step.name in next_reader:
            readers[id(step)] = next_reader[step.name]
    return readers
