"""Data-parallel training on torch.distributed: one trainer per rank, gradients averaged in the step.

Owns what makes an :class:`~ort_offload.trainer.OrtTrainer` one of N data-parallel ranks:
picking up the process group, splitting the global batch by rank, the step order that puts
every gradient before every state update (:func:`gradients_first`, with a block cut between
them), the reduction of the gradients in buckets done by that cut (in place, over tensors that
share memory with the arena or the host store; to their owners where optimizer state is sharded,
:mod:`ort_offload.sharding`, with the parameters gathered back after the step), the start-up
check that every rank runs the same graph, budget and plan, and the communication statistics of
the report.

The collectives are torch.distributed's (gloo on the CPU device); ranks that die or time out
surface as :class:`~ort_offload.errors.DistributedError` on the others.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import gc
import hashlib
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
import torch.distributed as dist

from graph_passes.ir.liveness import ancestor_nodes, node_io
from graph_passes.planning.schedule import training_spine
from graph_passes.ir.training_graph import Role, TrainingGraph
from graph_passes.planning.blocks import BlockLayouts, PlanningTarget
from graph_passes.planning.driver import StepPlanner
from ort_offload.runtime.offload_device import OffloadDevice
from ort_offload.runtime.planning import planning_target
from ort_offload import torch_checkpoint
from ort_offload.checkpoint import Checkpoint, check_state, write_checkpoint
from ort_offload.errors import CheckpointError, DistributedError, InputMismatchError, UnknownDeviceError, UnsupportedGraphError
from ort_offload.grad_buckets import InFlight, ReducePlan, reduce_plan
from ort_offload.runtime.runner import GraphRunner
from ort_offload.sharding import RELEASE_PREFIX, Shards, partition_parameters, rank_graph
from ort_offload.trainer import OrtTrainer

logger = logging.getLogger(__name__)

# Seconds a collective waits for a rank that is alive but silent (the CLI's process group); a
# rank that exits closes its connections, which the others see at once. Rank 0 exports the
# step while the others wait at a barrier, so this must cover an export.
DEFAULT_TIMEOUT_S = 300.0
# The report keys a data-parallel trainer adds to OrtTrainer's.
DISTRIBUTED_REPORT_KEYS = ("world_size", "rank", "allreduce_bytes", "allgather_bytes", "comm_time_s",
                           "comm_overlap_fraction", "shard_optimizer_state", "optimizer_state_bytes")


# ---- process group and batch --------------------------------------------------------------


def data_parallel_group(process_group: Any = None):
    """The group to train data-parallel over: ``process_group``, else the default group where
    one is initialised, else None (a single-process trainer)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def init_from_environment(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the default gloo group from torchrun's environment (``WORLD_SIZE``, ``RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``); True if this process is one of several ranks."""
    if dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d of %d: gloo process group initialised", dist.get_rank(), dist.get_world_size())
    return True


def is_writer(group: Any = None) -> bool:
    """Whether this process writes shared files: rank 0, or a process without a group."""
    group = data_parallel_group(group)
    return group is None or dist.get_rank(group) == 0


@contextlib.contextmanager
def rank_zero_first(group: Any):
    """Rank 0 runs the body first, the others after it (they then read its export cache entry
    instead of exporting the same step at once)."""
    if group is None:
        yield
        return
    rank = dist.get_rank(group)
    if rank != 0:
        with collective(rank, "waiting for rank 0's export"):
            dist.barrier(group=group)
    yield
    if rank == 0:
        with collective(rank, "export barrier"):
            dist.barrier(group=group)


def shard_batch(batch: Sequence[Any], rank: int, world_size: int) -> tuple:
    """This rank's slice (along the first axis) of each tensor of the global ``batch``."""
    shards = []
    for tensor in batch:
        size = int(tensor.shape[0]) if getattr(tensor, "ndim", 0) else 0
        if size == 0 or size % world_size:
            raise InputMismatchError(f"a global batch of {size} does not split evenly over {world_size} ranks: "
                                     f"give a batch size divisible by {world_size}")
        per_rank = size // world_size
        shards.append(tensor[rank * per_rank:(rank + 1) * per_rank])
    return tuple(shards)


# ---- the step order ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GradientOrder:
    """A schedule that makes every gradient (and the loss) before any state update, and the
    position where the updates start (a block boundary)."""

    schedule: tuple[int, ...]
    cut: int


def gradients_first(model: onnx.ModelProto, graph: TrainingGraph, schedule: Sequence[int] | None = None,
                    io=None) -> GradientOrder:
    """``schedule`` (default: node order) with the nodes the loss and gradients depend on moved
    ahead of the rest, each part in its given order (still topological: the moved set is
    closed under dependencies). Raises :class:`UnsupportedGraphError` for a graph without
    gradients or whose updated state feeds the loss."""
    nodes = list(model.graph.node)
    io = io if io is not None else node_io(nodes)
    spine = training_spine(graph.roles, graph.state_pairs, [o.name for o in model.graph.output])
    if spine is None:
        raise UnsupportedGraphError(f"{graph.name} has no gradients: data-parallel training needs a training step")
    producer = {name: index for index, entry in enumerate(io) for name in entry.outputs}
    keep = ancestor_nodes(nodes, spine, producer, io)
    updated = set(graph.state_pairs.values())
    if any(name in updated for index in keep for name in io[index].outputs):
        raise UnsupportedGraphError(f"{graph.name}'s loss or gradients read updated state: "
                                    "data-parallel training needs the updates after the backward")
    order = list(range(len(nodes))) if schedule is None else list(schedule)
    first = [index for index in order if index in keep]
    rest = [index for index in order if index not in keep]
    # Sharded state: the reads that hold other ranks' gradients until the reduction come first
    released = [index for index in rest if nodes[index].name.startswith(RELEASE_PREFIX)]
    rest = released + [index for index in rest if index not in set(released)]
    return GradientOrder(tuple(first + rest), len(first))


# ---- communication -------------------------------------------------------------------------


@dataclasses.dataclass
class CommStats:
    """What this rank's collectives moved and cost, over the run."""

    allreduce_bytes: int = 0  # gradient bytes this rank handed to all-reduce (or reduce, to their owners)
    allgather_bytes: int = 0  # parameter bytes gathered from their owners (sharded state)
    comm_time_s: float = 0.0  # wall time in collectives of the step
    hidden_time_s: float = 0.0  # ... of which ran while the step computed


class GradientReducer:
    """Averages arrays across the ranks of a group, in place (torch tensors over their memory).

    Every reducer lets go of its group when the interpreter exits (:func:`_release_groups`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        _LIVE_REDUCERS.add(self)

    def reduce(self, array: np.ndarray, owner: int | None) -> None:
        """Sum ``array`` over the ranks, in place, into ``owner``'s copy (None: every rank's)."""
        tensor = torch.from_numpy(array)
        if owner is None:
            dist.all_reduce(tensor, group=self.group)
        else:
            dist.reduce(tensor, dst=dist.get_global_rank(self.group, owner), group=self.group)

    def gather_from_owners(self, arrays: Sequence[np.ndarray], owners: Sequence[int], *, what: str) -> None:
        """Overwrite each array (in place) with its owner's (parameters after the update)."""
        started = time.perf_counter()
        with collective(self.rank, what):
            for array, owner in zip(arrays, owners):
                dist.broadcast(torch.from_numpy(array), src=dist.get_global_rank(self.group, owner), group=self.group)
        self.stats.comm_time_s += time.perf_counter() - started
        self.stats.allgather_bytes += sum(array.nbytes for array in arrays)

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks (a loss)."""
        tensor = torch.tensor([value], dtype=torch.float64)
        with collective(self.rank, "loss all-reduce"):
            dist.all_reduce(tensor, group=self.group)
        return float(tensor[0] / self.world_size)

    def broadcast(self, array: np.ndarray, *, src: int = 0, what: str = "broadcast from rank 0") -> None:
        """Overwrite ``array`` with rank ``src``'s (in place)."""
        with collective(self.rank, what):
            dist.broadcast(torch.from_numpy(array), src=dist.get_global_rank(self.group, src), group=self.group)

    def barrier(self, what: str) -> None:
        with collective(self.rank, what):
            dist.barrier(group=self.group)


# A gloo process group that outlives ``destroy_process_group`` because something still refers
# to it is destroyed during the interpreter's teardown, where its threads abort the process
# ("terminate called without an active exception", about one exit in four under torchrun).
# At exit, before that teardown, every reducer drops its reference, so a destroyed group goes
# while the interpreter still runs; a group not destroyed stays torch's (its registry holds it).
_LIVE_REDUCERS: "weakref.WeakSet[GradientReducer]" = weakref.WeakSet()


@atexit.register
def _release_groups() -> None:
    for reducer in list(_LIVE_REDUCERS):
        reducer.group = None
    gc.collect()


class collective:
    """Turns a failed collective into a one-line :class:`DistributedError` naming this rank."""

    def __init__(self, rank: int, what: str) -> None:
        self.rank, self.what = rank, what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and isinstance(error, (RuntimeError, dist.DistBackendError)) and not isinstance(
                error, DistributedError):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DistributedError(f"rank {self.rank}: {self.what} failed ({first[:200]}): another rank died, "
                                   "raised or timed out; restart every rank (from the last checkpoint)") from error
        return False


# ---- the runner ----------------------------------------------------------------------------


class GradientsFirstLayouts(BlockLayouts):
    """Block layouts in the gradients-first order, cut where the updates start."""

    def __init__(self, target: PlanningTarget) -> None:
        super().__init__(target)
        self._orders: dict[tuple, tuple[onnx.ModelProto, GradientOrder]] = {}

    def gradient_order(self, model: onnx.ModelProto, schedule) -> GradientOrder:
        """:func:`gradients_first` of ``model`` under ``schedule``, once per pair."""
        key = (id(model), None if schedule is None else tuple(schedule))
        entry = self._orders.get(key)
        if entry is None:
            order = gradients_first(model, self.target.graph, schedule, io=self.node_io_of(model))
            entry = self._orders[key] = (model, order)
        return entry[1]

    def lower_program(self, model, infos, schedule, *, max_block_nodes: int, extra_cuts=()):
        """Every lowering in the gradients-first order, cut where the updates start."""
        order = self.gradient_order(model, schedule)
        return super().lower_program(model, infos, order.schedule, max_block_nodes=max_block_nodes,
                                     extra_cuts=(*extra_cuts, order.cut))

    def updates_cut(self, model, schedule) -> int | None:
        return self.gradient_order(model, schedule).cut


def data_parallel_planner(runtime, graph: TrainingGraph, *, fetches, passes) -> StepPlanner:
    """The step planner of a data-parallel rank: gradients first, no updates interleaved with
    the backward (they would run before the gradients are averaged)."""
    target = planning_target(graph, runtime.device, fetches=fetches, passes=passes, profile=runtime.planning_profile)
    if target.swap_points is not None:
        raise UnsupportedGraphError(f"{graph.name} carries swap nodes from `ort-offload transform`: "
                                    "train the untransformed graph data-parallel")
    order = gradients_first(target.model, graph, target.schedule)
    target = dataclasses.replace(target, schedule=order.schedule, updates_early=False)
    return StepPlanner(target, layouts=GradientsFirstLayouts(target))


class DataParallelRunner(GraphRunner):
    """A :class:`GraphRunner` whose programs make every gradient before a block cut and average
    them across ranks: each block's gradients are handed to a communication thread once it has
    run (:mod:`ort_offload.grad_buckets`), and all are done before the first block that reads one."""

    def __init__(self, runtime, graph: TrainingGraph, *, reducer: GradientReducer, fetches=None, passes=(),
                 shards: Shards | None = None) -> None:
        """``shards``: each gradient goes to the rank that updates with it (sharded state)
        instead of being averaged on every rank."""
        grads = {n for n, role in graph.roles.items() if role == Role.GRAD}
        if grads & set(fetches or ()):
            raise UnsupportedGraphError(f"{graph.name} fetches gradients: data-parallel training averages them "
                                        "inside the step; fetch the loss only")
        planner = data_parallel_planner(runtime, graph, fetches=fetches, passes=passes)
        super().__init__(runtime, graph, fetches=fetches, passes=passes, planner=planner)
        self.reducer = reducer
        self.shards = shards
        self.gradient_names = grads
        producer = {name: index for index, node in enumerate(graph.model.graph.node) for name in node.output}
        self._order = {name: producer.get(name, -1) for name in grads}  # the same on every rank
        self._plans: dict[int, tuple[Any, ReducePlan]] = {}  # id(program) -> (program, its plan)
        self._step: tuple[Any, InFlight] | None = None  # (the step's execution, its collectives)
        self.before_block = self._before_block
        self.after_block = self._after_block

    def reduce_plan(self, program) -> ReducePlan:
        """Where ``program``'s gradients are reduced (:func:`~ort_offload.grad_buckets.reduce_plan`)."""
        entry = self._plans.get(id(program))
        if entry is None:
            entry = self._plans[id(program)] = (program, reduce_plan(program, self._order))
        return entry[1]

    def _owner(self, name: str) -> int | None:
        return None if self.shards is None else self.shards.grad_owner[name]

    def _in_flight(self, execution) -> InFlight:
        """This step's collectives; the first call of a step makes the arena wait for them
        before it moves bytes (they write into it)."""
        if self._step is None or self._step[0] is not execution:
            flight = InFlight(self.reducer.reduce)
            self._step = (execution, flight)
            arena, drain = execution.arena, execution.arena.before_move

            def before_move() -> None:
                with collective(self.reducer.rank, "gradient reduction"):
                    flight.wait()
                if drain is not None:
                    drain()
            arena.before_move = before_move
        return self._step[1]

    def _after_block(self, execution, block: int) -> None:
        """Issue the bucket(s) this block completed."""
        plan = self.reduce_plan(execution.prepared.program)
        ready = plan.ready_after.get(block)
        if not ready or not execution.arena.eager:
            return
        flight = self._in_flight(execution)
        for name in plan.names[flight.issued:ready]:
            flight.add(execution.arena.view(name), self._owner(name))
        flight.issued = ready

    def _before_block(self, execution, block: int) -> None:
        """Before the first block that reads a gradient: the rest issued, all waited for, averaged."""
        plan = self.reduce_plan(execution.prepared.program)
        if block != plan.first:
            return
        flight = self._in_flight(execution)
        values = execution.current_values(plan.names)  # where each is now (early ones: unmoved, or waited for)
        for name in plan.names[flight.issued:]:
            flight.add(values[name], self._owner(name))
        with collective(self.reducer.rank, "gradient reduction"):
            flight.wait()
        for name in plan.names:
            if self._owner(name) in (None, self.reducer.rank):
                torch.from_numpy(values[name]).div_(self.reducer.world_size)
        span, hidden = flight.times()
        stats = self.reducer.stats
        stats.comm_time_s += span
        stats.hidden_time_s += hidden
        stats.allreduce_bytes += sum(values[n].nbytes for n in plan.names)
        self._step = None


# ---- the trainer ---------------------------------------------------------------------------


class DistributedTrainer(OrtTrainer):
    """One data-parallel rank: trains on its shard of each global batch, with gradients
    averaged across the group inside the step, so every rank holds the same state.

    With ``shard_optimizer_state`` (ZeRO stage 1-2) the rank keeps the optimizer moments of,
    and updates, only its share of the parameters (:mod:`ort_offload.sharding`): each gradient
    is summed into its owner, the owner updates, and every parameter is then broadcast from its
    owner. ``flat_state()`` and ``save()`` gather the whole state (every rank must call them)."""

    def __init__(self, device: OffloadDevice, graph: TrainingGraph, *, process_group: Any,
                 shard_optimizer_state: bool = False, **options) -> None:
        """As :class:`OrtTrainer`, with ``example_batch`` this rank's shard."""
        if device.kind != "cpu":
            raise UnknownDeviceError(f"data-parallel training runs on the CPU device (gloo) for now, not {device.name}")
        self.reducer = GradientReducer(process_group)
        self.rank, self.world_size = self.reducer.rank, self.reducer.world_size
        check_agreement(self.reducer, start_facts(graph, device, options.get("example_batch", {}),
                                                  sharded=shard_optimizer_state))
        initial = options["initial_state"]
        self.full_state_infos = {n: (initial[n].dtype, tuple(initial[n].shape)) for n in graph.state_inputs}
        self.shards: Shards | None = None
        if shard_optimizer_state:
            self.shards = partition_parameters(graph, {n: initial[n].nbytes for n in graph.state_inputs},
                                               self.world_size)
            graph = rank_graph(graph, self.shards, self.rank)
            options["initial_state"] = {n: initial[n] for n in graph.state_inputs}
        super().__init__(device, graph, **options)
        # Rank 0's initial state everywhere (as DDP's constructor); sharded moments start at zero
        sharded = self.shards.sharded_state() if self.shards is not None else {}
        for name in graph.state_inputs:
            if name not in sharded:
                array = self.runtime.read(name)
                self.reducer.broadcast(array)
                self.runtime.write(name, array)
        check_agreement(self.reducer, plan_facts(self))
        # In input order: the same on every rank (state_pairs' order is not: a graph read from the
        # export cache has it sorted)
        self._buffers = [n for n in graph.state_inputs if n in graph.state_pairs and graph.roles.get(n) == Role.BUFFER]

    def _make_runner(self, graph: TrainingGraph) -> GraphRunner:
        return DataParallelRunner(self.runtime, graph, reducer=self.reducer, fetches=graph.step_fetches,
                                  passes=self.passes, shards=self.shards)

    def step(self, *batch) -> float:
        """One step on the global ``batch``: this rank's shard runs here; returns the global loss."""
        local = shard_batch(batch, self.rank, self.world_size)
        loss = super().step(*local)
        if self.shards is not None:
            self._gather_parameters()
        for name in self._buffers:  # statistics of this rank's shard: rank 0's win (as DDP)
            array = self.runtime.read(name)
            self.reducer.broadcast(array)
            self.runtime.write(name, array)
        if self.graph.loss_name is None:
            return loss
        loss = self.reducer.mean(loss)
        self.losses[-1] = loss
        return loss

    def _gather_parameters(self) -> None:
        """Every parameter from the rank that updated it, written in place where it lives."""
        runtime, names = self.runtime, list(self.shards.owner)
        arrays, copies = [], []
        for name in names:
            if name in runtime.arena and runtime.arena.eager:  # its arena memory
                runtime.host.discard(name)  # a host copy of the old value would go stale
                arrays.append(runtime.arena.view(name))
            elif name in runtime.arena:  # device memory: through a host copy
                arrays.append(runtime.read(name))
                copies.append(len(arrays) - 1)
            else:  # kept in the host store between steps
                arrays.append(runtime.host.get(name))
        self.reducer.gather_from_owners(arrays, [self.shards.owner[n] for n in names], what="parameter gather")
        for index in copies:
            runtime.write(names[index], arrays[index])

    # ---- state ----------------------------------------------------------------------------------

    def flat_state(self) -> dict[str, np.ndarray]:
        """The whole state by graph name (with sharded state, gathered from the owners: every
        rank calls this)."""
        local = super().flat_state()
        if self.shards is None:
            return local
        owners = self.shards.sharded_state()
        full = {}
        for name, (dtype, shape) in self.full_state_infos.items():
            if name in owners:
                array = local[name] if owners[name] == self.rank else np.empty(shape, dtype)
                self.reducer.broadcast(array, src=owners[name], what="optimizer state gather")
                full[name] = array
            else:
                full[name] = local[name]
        return full

    def _checked_state(self, state: Any) -> dict[str, np.ndarray]:
        """A whole state (as any trainer saves it) checked, then cut to this rank's share."""
        if self.shards is None or not isinstance(state, Mapping) or set(state) == set(self.graph.state_inputs):
            return super()._checked_state(state)
        full = check_state(state, self.full_state_infos)
        return super()._checked_state({n: full[n] for n in self.graph.state_inputs})

    def save(self, path) -> Path:
        """Rank 0 writes the checkpoint of the whole state; all return once it exists."""
        if self.shards is None:
            written = super().save(path) if self.rank == 0 else Path(path)
        else:
            if torch_checkpoint.is_torch_path(path):
                raise CheckpointError("a trainer with sharded optimizer state saves .npz checkpoints: "
                                      "give a path ending in .npz")
            state = self.flat_state()
            written = Path(path) if self.rank else write_checkpoint(
                path, Checkpoint(model=self.name, steps=self.steps_done, losses=list(self.losses), state=state))
        self.reducer.barrier("checkpoint barrier")
        return written

    def state_dict(self) -> dict[str, Any]:
        if self.shards is not None:
            raise CheckpointError("state_dict() in torch's layout needs every rank's optimizer state: use "
                                  "flat_state() or save() to a .npz path, or train without shard_optimizer_state")
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.shards is not None:
            raise CheckpointError("a trainer with sharded optimizer state loads .npz checkpoints only (load())")
        super().load_state_dict(state)

    def report(self) -> dict[str, Any]:
        """:class:`OrtTrainer`'s report with the data-parallel keys (:data:`DISTRIBUTED_REPORT_KEYS`)."""
        stats = self.reducer.stats
        report = super().report()
        optimizer_state = [n for n in self.graph.state_inputs if self.graph.roles.get(n) == Role.OPTIMIZER_STATE]
        report.update({
            "world_size": self.world_size,
            "rank": self.rank,
            "allreduce_bytes": stats.allreduce_bytes,
            "allgather_bytes": stats.allgather_bytes,
            "comm_time_s": stats.comm_time_s,
            "comm_overlap_fraction": stats.hidden_time_s / stats.comm_time_s if stats.comm_time_s else 0.0,
            "shard_optimizer_state": self.shards is not None,
            "optimizer_state_bytes": sum(self.runtime.info(n).nbytes for n in optimizer_state),
        })
        return report


# ---- start-up agreement --------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def start_facts(graph: TrainingGraph, device: OffloadDevice, batch: Mapping[str, np.ndarray], *,
                sharded: bool = False) -> dict[str, str]:
    """What every rank must agree on before planning: the graph, the budget, the batch shard,
    whether optimizer state is sharded."""
    return {
        "graph": _digest(graph.model.graph.SerializeToString()),
        "budget": "unlimited" if device.budget is None else str(device.budget),
        "batch shard": ", ".join(f"{n} {tuple(a.shape)}" for n, a in batch.items()),
        "optimizer state sharding": "on" if sharded else "off",
    }


def plan_facts(trainer: DistributedTrainer) -> dict[str, str]:
    """What every rank must agree on after planning: the budget in bytes (unsharded: with
    sharded state a fraction resolves against each rank's own graph) and the gradients it averages."""
    prepared = trainer.runner.last_prepared
    names = trainer.runner.reduce_plan(prepared.program).names
    shapes = ";".join(f"{n}{prepared.infos[n].shape}{prepared.infos[n].dtype}" for n in names)
    facts = {"averaged gradients": _digest(shapes.encode())}
    if trainer.shards is None:
        facts["budget bytes"] = str(trainer.runtime.budget_bytes)
    return facts


def check_agreement(reducer: GradientReducer, facts: Mapping[str, str]) -> None:
    """Raise :class:`DistributedError` on every rank if any rank's ``facts`` differ from rank 0's."""
    gathered: list[Any] = [None] * reducer.world_size
    with collective(reducer.rank, "start-up check"):
        dist.all_gather_object(gathered, dict(facts), group=reducer.group)
    reference = gathered[0]
    differs = [(rank, key) for rank, other in enumerate(gathered[1:], start=1) for key in reference
               if other.get(key) != reference[key]]
    if differs:
        # Every rank leaves the gather before any raises: a rank that exits at once could cut
        # another's gather short, which would then report a broken connection instead.
        with contextlib.suppress(RuntimeError):
            dist.barrier(group=reducer.group)
        rank, key = differs[0]
        other, value = gathered[rank], reference[key]
        raise DistributedError(f"rank {rank} differs from rank 0 in its {key} ({other.get(key)} against {value}): "
                               "start every rank with the same model, batch, budget and options")


__all__ = [
    "DEFAULT_TIMEOUT_S", "DISTRIBUTED_REPORT_KEYS", "CommStats", "DataParallelRunner", "DistributedTrainer",
    "GradientOrder", "GradientReducer", "data_parallel_group", "gradients_first", "init_from_environment",
    "is_writer", "rank_zero_first", "shard_batch",
]
