"""The execution provider: runs lowered training-step programs under the device budget.

:class:`Runtime` owns one device's arena, host store and statistics; :class:`GraphRunner`
runs one graph on it: per input signature it has the step planner
(:mod:`graph_passes.planning.driver`) choose a program of blocks and memory steps that fits the
budget, then executes the steps with one ONNX Runtime session per block bound into arena memory. The device's memory, copy
engines and providers come from its backend (:mod:`ort_offload.runtime.device_backend`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Mapping, Sequence

import numpy as np
import onnx

from graph_passes.ir import shapes
from graph_passes.cost.device_profiles import DeviceProfile, get_profile
from graph_passes.ir.memory import MemoryTrace, allocation_units
from graph_passes.ir.program import (
    Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut, is_order_dependent,
)
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.swap.planner import SwapPlan
from graph_passes.planning.driver import StepPlanner
from ort_offload.runtime.planning import plan_or_raise, planning_target
from graph_passes.ir.training_graph import TrainingGraph
from ort_offload.runtime.arena import DeviceArena, OutOfArenaMemory, make_policy
from ort_offload.runtime.block_session import BlockSession, block_content_key, block_model, default_session_options
from ort_offload.budget import format_bytes
from ort_offload.budget_basis import FIRST_BATCH, BudgetBasis
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.runtime.placed_steps import PlacedSteps
from ort_offload.runtime.device_backend import DeviceBackend, make_backend
from ort_offload.runtime.device_memory import all_finite
from ort_offload.errors import BudgetTooSmallError, ExecutionError, OffloadError
from ort_offload.runtime.gc_pause import collection_paused
from ort_offload.runtime.host_slots import signature_values
from ort_offload.runtime.host_store import HostStore
from graph_passes.ort_logging import ort_error_summary

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
    split_plan: object = None  # graph_passes.planning.split.planner.JointPlan
    # What every run of this program derives from it alone (each RunBlock step's _BlockLayout,
    # the first readers, the placed steps: ort_offload.runtime.placed_steps), made at its first run. It lives and
    # dies with this immutable program, so it cannot go stale.
    run_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


class Runtime:
    """One device's memory (arena + host store) shared by every graph that runs on it."""

    def __init__(self, device: OffloadDevice, *, backend: DeviceBackend | None = None) -> None:
        """``backend``: the device's memory, copy engines and providers (default: the one
        ``device.kind`` names; tests pass :func:`~ort_offload.runtime.device_backend.stream_backend`)."""
        self.device = device
        self.backend = backend if backend is not None else make_backend(device)
        self.host = HostStore(self.backend.memory.host_empty)
        self.arena: DeviceArena | None = None
        self.budget_bytes: int | None = None if device.budget is None else device.budget.nbytes
        self.budget_basis: BudgetBasis | None = None  # the unplanned peak fractions resolve against
        self.stats = RuntimeStats()
        self.copy_engine = self.backend.h2d  # swap-ins
        # Changes whenever a state tensor's dtype or shape may have changed (new placement, a
        # step whose updated state differs from what it replaced): input checks of the state
        # made at one version hold until the next (OrtTrainer's per-batch-signature cache).
        self.state_version = 0
        self.evict_engine = self.backend.d2h  # swap-outs
        self._floating_names: dict[tuple[str, ...], _Names] = {}  # first_nonfinite's, at _floating_version
        self._floating_version = -1
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

    def resolve_budget(self, baseline_peak_bytes: int, *, shapes: Mapping[str, tuple[int, ...]] | None = None,
                       source: str = FIRST_BATCH) -> int | None:
        """Bytes of the budget. A fraction resolves once, against :attr:`budget_basis`: the
        basis fixed before planning (:meth:`fix_budget_basis`), else the first unplanned peak
        seen (``baseline_peak_bytes``, at batch ``shapes``, from ``source``)."""
        if self.budget_basis is None:
            self.budget_basis = BudgetBasis(baseline_peak_bytes, source, dict(shapes or {}))
        if self.budget_bytes is None and self.device.budget is not None:
            self.budget_bytes = self.device.budget.resolve(self.budget_basis.peak_bytes)
        return self.budget_bytes

    def fix_budget_basis(self, basis: BudgetBasis) -> None:
        """Resolve fractions against ``basis`` (a planned graph's recorded peak); before any planning."""
        if self.budget_basis is not None:
            raise ValueError("the budget basis is fixed when the first graph is planned")
        self.budget_basis = basis

    def place_state(
        self, state: Mapping[str, np.ndarray], order: Sequence[str], capacity: int, *, host: Sequence[str] = ()
    ) -> None:
        """Put the trainer's state into a fresh arena, packed in ``order``; ``host`` names
        state a swap plan keeps in the host store between steps."""
        self.state_version += 1
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
        floating = self._floating(names)
        if self.arena.holds_all(floating.names):  # the usual case: one fused check
            with self.backend.on_compute_stream():
                if self.arena.all_finite(floating.order):
                    return None
        resident = [n for n in floating.order if n in self.arena]
        with self.backend.on_compute_stream():
            finite = dict(zip(resident, self.arena.finite(resident)))
        for name in floating.order:
            ok = finite[name] if name in finite else all_finite(self.host.get(name))
            if not ok:
                return name
        return None

    def _floating(self, names) -> "_Names":
        """Those of ``names`` that hold floating values (not empty): kept per list of names
        until :attr:`state_version` changes (the only time a state tensor's dtype or shape can)."""
        key = tuple(names)
        if self._floating_version != self.state_version:
            self._floating_names.clear()
            self._floating_version = self.state_version
        floating = self._floating_names.get(key)
        if floating is None:
            order = tuple(n for n in key if (info := self.info(n)).nbytes and _is_floating(info.dtype))
            floating = self._floating_names[key] = _Names(order, frozenset(order))
        return floating

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


@dataclasses.dataclass(frozen=True)
class _Names:
    """Names in order, and as a set."""

    order: tuple[str, ...]
    names: frozenset[str]


@functools.cache
def _is_floating(dtype: np.dtype) -> bool:
    return bool(np.issubdtype(dtype, np.floating))


class GraphRunner:
    """Runs one training-step (or forward) graph on a :class:`Runtime`."""

    def __init__(
        self, runtime: Runtime, graph: TrainingGraph, *, fetches: Sequence[str] | None = None, passes: Sequence[str] = (),
        planner: StepPlanner | None = None,
    ) -> None:
        """``planner``: plans this graph (default: the step planner on the device's target)."""
        self.runtime = runtime
        self.graph = graph
        self.fetches = fetches
        self.planner = planner or StepPlanner(planning_target(graph, runtime.device, fetches=fetches, passes=passes,
                                                              profile=runtime.planning_profile,
                                                              session_bytes=runtime.backend.session_bytes,
                                                              scatters_as_matmuls=runtime.backend.scatters_race))
        target = self.planner.target
        # The graph as it runs: its standard-op form where it carries swap nodes (they fix where
        # it swaps), order-dependent nodes scheduled last.
        self.model, self.swap_points, self.schedule, self.passes = (target.model, target.swap_points,
                                                                    target.schedule, target.passes)
        # Called as before_block(execution, block) once a block's inputs are resident, before it
        # runs (data-parallel training averages gradients there: ort_offload.distributed), and
        # after_block(execution, block) once it has run, before its frees (it issues their reduction).
        self.before_block = None
        self.after_block = None
        self._prepared: dict[tuple, PreparedStep] = {}
        self._prepared_by_id: dict[int, PreparedStep] = {}  # the same programs (they are never dropped)
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
        self.last_trace: MemoryTrace | None = None
        self.last_prepared: PreparedStep | None = None
        self.step_times_s: list[float] = []
        self.placed = PlacedSteps(self)  # steps placed ahead (static memory plans), per program
        self.declared_inputs = shapes.declared_inputs(self.model)

    # ---- planning --------------------------------------------------------------------------

    def prepare(self, input_infos: Mapping[str, TensorInfo], *, probe_feeds=None,
                basis_source: str = FIRST_BATCH) -> PreparedStep:
        """Lower and check the graph for these input shapes (cached per signature).

        ``probe_feeds``: input values for shape probes, or a function returning them (called
        only when this signature is new). ``basis_source``: what these shapes are, should a
        fraction budget resolve against their unplanned peak (the first signature planned)."""
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
            prepared = self._prepare_signature(signature, input_infos, probe_feeds, basis_source)
        self._prepared[signature] = prepared
        self._prepared_by_id[id(prepared)] = prepared
        self.last_trace = prepared.trace
        self.last_prepared = prepared
        self.runtime.stats.plan_time_s += time.perf_counter() - start
        logger.info(
            "prepared %s: %d blocks, unplanned peak %s, this program's minimum budget %s",
            self.graph.name, len(prepared.program.blocks), format_bytes(self.baseline_peak_bytes),
            format_bytes(prepared.trace.min_budget_bytes),
        )
        return prepared

    def prepared_again(self, prepared: PreparedStep) -> PreparedStep:
        """Count a step that runs ``prepared`` (a program of this runner, looked up by the
        caller) as :meth:`prepare`'s cache would."""
        if self._prepared_by_id.get(id(prepared)) is not prepared:  # (hashing the signature costs more)
            raise ValueError(f"{self.graph.name}: that program was not prepared by this runner")
        self.runtime.stats.plan_cache_hits += 1
        self.last_trace = prepared.trace
        self.last_prepared = prepared
        return prepared

    def _prepare_signature(self, signature, input_infos: Mapping[str, TensorInfo], probe_feeds,
                           basis_source: str) -> PreparedStep:
        """What ``prepare`` does for a signature not seen before: plan, or say what budget would do."""
        shapes = {n: input_infos[n].shape for n in self.graph.data_inputs if n in input_infos}
        plan = plan_or_raise(self.planner, input_infos, probe_feeds=probe_feeds,
                             resolve_budget=functools.partial(self.runtime.resolve_budget, shapes=shapes,
                                                              source=basis_source),
                             session_bytes=self.runtime.backend.session_bytes)
        choice = plan.choice
        return PreparedStep(signature, plan.infos, choice.program, choice.trace, choice.passes, choice.base,
                            choice.swap_plan, model=plan.model, recomputed_nodes=plan.recomputed_nodes,
                            split_nodes=plan.split_nodes, split_plan=plan.split_plan)

    # The planner's state, read by the trainer, the report and the benchmarks.
    @property
    def recompute(self):
        return self.planner.recompute

    @property
    def baseline_peak_bytes(self) -> int | None:
        return self.planner.baseline_peak_bytes

    @property
    def baseline_trace(self) -> MemoryTrace | None:
        return self.planner.baseline_trace

    @property
    def last_choice(self) -> list[tuple[str, float]]:
        return self.planner.last_choice

    @property
    def last_segment_costs(self) -> list:
        return self.planner.last_segment_costs

    @property
    def last_plan_search(self):
        return self.planner.last_plan_search

    def prepared_steps(self) -> list[PreparedStep]:
        """Every program prepared so far (one per input signature)."""
        return list(self._prepared.values())

    def tensor_budget(self, prepared: PreparedStep) -> int | None:
        """The budget less what the program's block sessions hold for themselves (None: unlimited)."""
        budget = self.runtime.budget_bytes
        if budget is None:
            return None
        return budget - len(prepared.program.blocks) * self.runtime.backend.session_bytes

    def capacity_for(self, prepared: PreparedStep) -> int:
        """Arena bytes for this program: the budget (less its sessions' own bytes)."""
        budget = self.tensor_budget(prepared)
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

    @property
    def session_count(self) -> int:
        """ONNX Runtime sessions the blocks hold now (a block has one per set of folded values)."""
        unique = {id(session): session for session in self._sessions.values()}  # blocks may share one
        return sum(session.variant_count for session in unique.values())

    def signature_values(self, prepared: PreparedStep) -> frozenset[str]:
        """Values of ``prepared``'s graph equal in every step of its signature."""
        model = prepared.model if prepared.model is not None else self.model
        entry = self._signature_values.get(id(model))
        if entry is None:
            entry = self._signature_values[id(model)] = (model, signature_values(model))
        return entry[1]

    def run(self, feeds: Mapping[str, np.ndarray], prepared: PreparedStep) -> dict[str, np.ndarray]:
        """Execute one step with batch tensors ``feeds``; returns the fetched outputs."""
        backend = self.runtime.backend
        counter = backend.counter.sampling() if backend.counter is not None else contextlib.nullcontext()
        with backend.on_compute_stream(), counter:  # device allocations and copies in stream order
            fetched = self._run(feeds, prepared)
        if backend.counter is not None:  # the device's own counter, sampled while the step ran
            stats = self.runtime.stats
            stats.measured_device_bytes = max(stats.measured_device_bytes or 0, backend.counter.peak)
        return fetched

    def _run(self, feeds: Mapping[str, np.ndarray], prepared: PreparedStep) -> dict[str, np.ndarray]:
        runtime = self.runtime
        arena = runtime.arena
        if prepared.program.host_state or not arena.holds_all(self._state_set(prepared)):
            self._place_state_for(prepared.program)
        arena.set_capacity(max(self.capacity_for(prepared), arena.allocator.high_water_live()))
        if not arena.eager:
            arena.reserve(prepared.trace.arena_high_water)
        started = time.perf_counter()
        table = self.placed.table(prepared)
        if table is not None:  # placed ahead: runs from its table
            try:
                fetched = self.placed.run(table, prepared, feeds)
            except Exception as e:
                self._abort(prepared.program, cause=e)
                raise
            peak = table.placed.peak_bytes
        else:
            fetched, peak = self._run_steps(prepared, feeds)
        runtime.stats.blocks_run += len(prepared.program.blocks)
        runtime.stats.peak_device_bytes = max(runtime.stats.peak_device_bytes, peak)
        self.step_times_s.append(time.perf_counter() - started)
        if runtime.backend.used_bytes is not None and runtime.backend.counter is None:  # the counter now
            measured = runtime.backend.used_bytes()
            runtime.stats.measured_device_bytes = max(runtime.stats.measured_device_bytes or 0, measured)
        return fetched

    def _run_steps(self, prepared: PreparedStep, feeds: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """Execute the program step by step; the fetched outputs and the step's peak."""
        runtime, arena = self.runtime, self.runtime.arena
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
        return execution.fetched, execution.peak

    def block_layout(self, prepared: PreparedStep, step: RunBlock) -> "_BlockLayout":
        """What running ``step`` binds, allocates and frees (this program's, made at its first
        run; the program holds its steps, so their ids are stable)."""
        layout = prepared.run_cache.get(id(step))
        if layout is not None:
            return layout
        block = prepared.program.blocks[step.block]
        session = self.session(prepared, step.block)
        names = session.names  # the order it binds in
        view_start = {whole: pieces[0] for whole, pieces in prepared.program.views}  # where a view is written
        units = tuple(allocation_units(prepared.program, step.allocates))
        infos = prepared.infos
        layout = prepared.run_cache[id(step)] = _BlockLayout(
            session=session, block=block,
            where=tuple(view_start.get(n, n) for n in names),
            shapes=tuple(infos[n].shape for n in names),
            units=units,
            outputs=None if any(pieces for _, pieces in units) else tuple((n, infos[n]) for n, _ in units),
            inputs=frozenset(block.inputs), frees=tuple(step.frees),
        )
        return layout

    def host_values(self, prepared: PreparedStep, session: BlockSession, read) -> dict[str, np.ndarray]:
        """Values of the block inputs ``session`` folds (shapes a device's kernels read on the
        host), each got with ``read(name)``: once per signature where they follow from the
        input shapes alone, else at every run."""
        values = {}
        for name in session.host_inputs:
            key = (prepared.signature, id(prepared.model), name)
            value = self.host_value_cache.get(key)
            if value is None:
                value = read(name)
                if name in self.signature_values(prepared):
                    self.host_value_cache[key] = value
            values[name] = value
        return values

    def block_failed(self, block: int, error: Exception) -> ExecutionError:
        """The error for block ``block`` failing in ONNX Runtime with ``error``."""
        return ExecutionError(
            f"block {block} of {self.graph.name} failed in ONNX Runtime ({ort_error_summary(error)}); "
            "check the batch values (e.g. token ids below the vocabulary size)"
        )

    @staticmethod
    def _state_set(prepared: PreparedStep) -> frozenset[str]:
        """The state ``prepared``'s program keeps resident, as a set (made once)."""
        names = prepared.run_cache.get("state_set")
        if names is None:
            names = prepared.run_cache["state_set"] = frozenset(prepared.program.state_inputs)
        return names

    def _place_state_for(self, program: Program) -> None:
        """Put the state where ``program``'s plan expects it before it runs: the state it keeps
        on the host out of the arena, the state it keeps resident into it. Another signature's
        plan may have left it elsewhere, and the plan's budget counts only its own placement."""
        arena, host = self.runtime.arena, self.runtime.host
        with self.runtime.backend.on_compute_stream():
            for name in program.host_state:
                if name in arena:
                    host.put(name, arena.read(name))
                    arena.free(name)
            for name in program.state_inputs:
                if name not in arena and name in host:
                    arena.store(name, host.get(name))
                    host.discard(name)

    def _abort(self, program: Program, *, cause: BaseException) -> None:
        """Free a failed step's temporaries; fail loudly (naming ``cause``) if state was
        already consumed."""
        arena, host = self.runtime.arena, self.runtime.host
        self.runtime.state_version += 1  # check the state again before the next step
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
        self.budget = runner.tensor_budget(prepared)
        self.drop_prefetches = runner.runtime.device.drop_prefetches
        self.copies = runner.runtime.copy_engine
        self.evictions = runner.runtime.evict_engine
        self.async_swap_outs = runner.runtime.device.swap_outs_are_async
        # Placement: which part of the arena each block's tensors go to (ort_offload.runtime.arena).
        usable = None if self.budget is None else self.budget - prepared.program.max_workspace_bytes
        self.policy = make_policy(runner.runtime.device.arena_policy, usable=usable, alignment=self.arena.alignment)
        cache = prepared.run_cache
        if "first_readers" not in cache:
            cache["first_readers"] = _first_readers(prepared.program)
        self.steered = self.policy.region(0) is not None  # whether the policy chooses regions at all
        self.first_reader = cache["first_readers"] if self.steered else {}
        self.block: int | None = None  # the block running or about to run
        # Swap-outs in flight: name -> the host buffer being filled. Their arena bytes stay
        # allocated until the copy is done and :meth:`_release` frees them.
        self.leaving: dict[str, np.ndarray] = {}
        # Swap-ins of at most this many bytes copy when issued (the device's choice), and wait
        # in ``arrived`` to be counted as prefetch hits where a block first reads them.
        self.inline_copy_bytes = runner.runtime.backend.inline_copy_bytes
        self.arrived: set[str] = set()
        # Compaction moves bytes: no copy may be reading or writing arena memory while it does.
        self.arena.before_move = self._drain

    def _drain(self) -> None:
        """Every copy finished (swap-outs are released later, by :meth:`_reap`)."""
        self.stats.swap_time_s += self.copies.drain() + self.evictions.settle()
        self.arrived.clear()  # as drain() consumes what was in flight: no prefetch hit counted later

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
        if self.leaving:  # swap-outs in flight: they may have to give their bytes back first
            self._with_room(lambda: self.arena.allocate(name, self.infos[name], region=region))
        else:  # what _with_room does when nothing is leaving
            self.arena.allocate(name, self.infos[name], region=region)
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
            if name in self.arrived:  # copied when issued: it had arrived
                self.arrived.discard(name)
                self.stats.prefetch_hits += 1
            elif self.copies.in_flight(name):
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
        layout = self.prepared.run_cache.get(id(step)) or self.runner.block_layout(self.prepared, step)
        # This signature's block: the session may have been made at another one, whose
        # workspace (shape-dependent) is not this step's.
        workspace = layout.block.workspace_bytes
        self.block = step.block
        self._cap(workspace)
        if self.leaving or self.arrived or self.copies.pending() or not arena.holds_all(layout.inputs):
            self._ensure_resident(layout.block.inputs, f"block {step.block}")
        if self.runner.before_block is not None:
            self.runner.before_block(self, step.block)
        if layout.outputs is not None and not self.leaving and not self.steered:
            arena.allocate_all(layout.outputs)  # what _allocate does for each, in one call
        else:
            for name, pieces in layout.units:
                if pieces:
                    self._allocate_view(name, pieces, step.block)
                else:
                    self._allocate(name, step.block)
        self._measure(workspace)
        session = layout.session
        try:
            session.run_at(arena.pointers(layout.where), layout.shapes, self.infos, self.runtime.backend,
                           self.runner.host_values(self.prepared, session, arena.read) if session.host_inputs else None)
        except Exception as e:
            raise self.runner.block_failed(step.block, e) from e
        if self.runner.after_block is not None:
            self.runner.after_block(self, step.block)
        arena.free_all(layout.frees)
        self.host.discard_all(layout.frees)  # a clean host copy dies with the value

    def fetch(self, step: Fetch) -> None:
        if self.leaving or self.arrived or self.copies.pending() or step.name not in self.arena:
            self._ensure_resident([step.name], f"fetch {step.name}")
        self.fetched[step.name] = self.arena.read(step.name)
        if step.free:
            self.arena.free(step.name)
            self.host.discard(step.name)

    def swap_out(self, step: SwapOut) -> None:
        name = step.name
        if name not in self.arena or name in self.leaving:  # out already (another signature's plan)
            return
        self.arrived.discard(name)
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
            nbytes = self.infos[name].nbytes
            if nbytes <= self.inline_copy_bytes:  # copied now: handing it to a copy thread costs more
                started = time.perf_counter()
                self.arena.write(name, self.host.get(name))
                self.stats.swap_time_s += time.perf_counter() - started
                self.arrived.add(name)
            else:
                self.copies.submit(name, self.arena.uploader(name, self.host.get(name)))
            self.stats.swap_ins += 1
            self.stats.swap_in_bytes += nbytes
            self._measure(0)

    def commit(self, step: Commit) -> None:
        self._drain()
        self._reap()
        keeps = self.prepared.run_cache.get(id(step))
        if keeps is None:  # whether each updated value has the dtype and shape of the state it replaces
            infos = self.infos
            keeps = self.prepared.run_cache[id(step)] = all(
                u in infos and s in infos and infos[u] == infos[s] for u, s in step.renames)
        if not keeps:
            self.runtime.state_version += 1
        arena, host = self.arena, self.host
        for updated, state in step.renames:
            if state in arena:
                arena.free(state)
            host.discard(state)  # the old value's host copy is stale now
            if updated in arena:
                arena.rename(updated, state)
                if updated in host:
                    host.rename(updated, state)  # a clean copy stays clean under the new name
            else:
                host.rename(updated, state)


@dataclasses.dataclass(frozen=True)
class _BlockLayout:
    """One ``RunBlock`` step of a prepared program as every run executes it."""

    session: BlockSession
    block: object  # graph_passes.ir.program.Block
    where: tuple[str, ...]  # the arena tensor holding each of session.names (a split view: its first piece)
    shapes: tuple[tuple[int, ...], ...]  # the shape of each of session.names at this signature
    units: tuple  # allocation_units of the step's allocations
    outputs: tuple | None  # the same as (name, TensorInfo) pairs where none is a split view
    inputs: frozenset[str]  # the block's inputs (checked resident at once)
    frees: tuple[str, ...]  # what the step frees after the run


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
