"""Steps run from placements computed ahead: a static memory plan per program.

A program makes the same allocations every step, and where best fit puts them depends only
on the arena's state when the step starts (:mod:`graph_passes.ir.step_placement`). The first
time a program starts from a state, its step is placed by a replay through a copy of the
allocator; a step that starts from a state placed before then writes its batch, runs its
blocks at the pointers the table holds (their IOBindings, made for the same pointers, bind
nothing), reads its fetches and takes the end state at once: no allocation, free or rename.

Without a budget the arena grows, and best fit never returns to an earlier state. From a
program's third step on, a step that starts where a placed best-fit step ended is placed to end
where that one started (``home``): the two alternate. A program's first two steps run by best
fit as they go, as the memory replay behind ``baseline_peak_bytes`` has them.

Only steps that nothing data-dependent can change run from a table: no swaps, no copies in
flight, nothing in the host store, no block hooks, no double buffering; every other step runs
step by step (``runner._StepExecution``), and a program whose tables keep missing stops
placing ahead.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from graph_passes.ir.program import Commit, Fetch, Load, RunBlock
from graph_passes.ir.shapes import TensorInfo
from graph_passes.ir.step_placement import PlacedStep, place_step
from ort_offload.runtime.block_session import BindingLayout

# Steps a program runs by best fit, step by step, before its steps are placed ahead (see above).
BEST_FIT_STEPS = 2
# Tables made in a row without one being reused: the program's states do not recur; it stops.
MAX_MISSES = 4


@dataclasses.dataclass
class PlacedTable:
    """One placed step of a program, ready to run."""

    placed: PlacedStep
    end_token: object  # the arena's state_token after the step
    end_infos: dict[str, TensorInfo]  # what the arena holds after the step
    ops: tuple  # (kind, name or layout, offsets, info) per Load, RunBlock and Fetch, in order
    freed_state: tuple[tuple[str, ...], ...]  # per op: state tensors consumed before it runs
    keeps: bool  # every update has its state's dtype and shape (the commit's check)
    base: int = -1  # the arena address ``pointers`` are for
    pointers: tuple = ()  # per op: the BindingLayout a block binds (None for other ops)


@dataclasses.dataclass
class _ProgramTables:
    """A program's tables by the arena state they start from (valid for one state version)."""

    version: int
    by_token: dict = dataclasses.field(default_factory=dict)
    homes: dict = dataclasses.field(default_factory=dict)  # end token -> start of a leaving step
    runs: int = 0
    misses: int = 0
    off: bool = False


class PlacedSteps:
    """The tables of one :class:`~ort_offload.runtime.runner.GraphRunner`'s programs."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def table(self, prepared) -> PlacedTable | None:
        """The placed step ``prepared`` runs now, or None (it runs step by step)."""
        runtime = self.runner.runtime
        tables = prepared.run_cache.get("placed")
        if tables is None or tables.version != runtime.state_version:
            tables = prepared.run_cache["placed"] = _ProgramTables(runtime.state_version)
        tables.runs += 1
        if tables.off or tables.runs <= BEST_FIT_STEPS or not self._static_now(prepared):
            return None
        token = runtime.arena.state_token()
        table = tables.by_token.get(token)
        if table is not None:
            tables.misses = 0
            return table
        tables.misses += 1
        if tables.misses > MAX_MISSES:
            tables.off = True
            return None
        table = self._make(prepared, tables, token)
        if table is not None:
            tables.by_token[token] = table
        return table

    def _static_now(self, prepared) -> bool:
        """Whether nothing outside the program can change this step's placements."""
        runner, runtime = self.runner, self.runner.runtime
        return (runner.before_block is None and runner.after_block is None and runtime.host.holds_nothing()
                and not runtime.copy_engine.pending() and not runtime.evict_engine.pending()
                and (runtime.device.arena_policy == "best_fit" or runner.tensor_budget(prepared) is None))

    def _make(self, prepared, tables: _ProgramTables, token: object) -> PlacedTable | None:
        """Place the step from the arena's state now; in a growable arena, one that leaves
        this state, or returns to the state a step that left it ended here came from."""
        arena, program = self.runner.runtime.arena, prepared.program
        budget = self.runner.tensor_budget(prepared)
        home = tables.homes.get(token) if arena.growable else None
        leave = arena.growable and home is None
        placed = place_step(program, prepared.infos, arena.allocator, budget=budget, home=home, leave=leave)
        if placed is None and arena.growable:
            home, leave = None, False
            placed = place_step(program, prepared.infos, arena.allocator, budget=budget)
        if placed is None:
            tables.off = bool(program.host_state) or any(
                not isinstance(s, (Load, RunBlock, Fetch, Commit)) for s in program.steps)  # it swaps
            return None
        end_token = arena.token_of(placed.end)
        if leave:
            tables.homes[end_token] = arena.allocator.clone()
        return self._table(prepared, placed, end_token)

    def _table(self, prepared, placed: PlacedStep, end_token: object) -> PlacedTable:
        arena, infos, program = self.runner.runtime.arena, prepared.infos, prepared.program
        renames = {s: u for step in program.steps if isinstance(step, Commit) for u, s in step.renames}
        held = arena.infos()
        end_infos = {n: infos[renames[n]] if n in renames else held.get(n) or infos[n] for n in placed.end.names()}
        keeps = all(u in infos and s in infos and infos[u] == infos[s] for s, u in renames.items())
        state = set(program.state_inputs)
        ops, freed, consumed = [], [], []
        for step, offsets in zip(program.steps, placed.offsets):
            if isinstance(step, Load):
                ops.append(("load", step.name, offsets[step.name], infos[step.name]))
            elif isinstance(step, RunBlock):
                layout = self.runner.block_layout(prepared, step)
                where = tuple(offsets[n] for n in layout.where)
                hosted = {n: offsets[n] for n in layout.session.host_inputs}
                ops.append(("run", layout, where, hosted))
            elif isinstance(step, Fetch):
                ops.append(("fetch", step.name, offsets[step.name], infos[step.name]))
            else:
                continue
            freed.append(tuple(consumed))
            if isinstance(step, RunBlock):
                consumed += [n for n in step.frees if n in state]
        return PlacedTable(placed, end_token, end_infos, tuple(ops), tuple(freed), keeps)

    def run(self, table: PlacedTable, prepared, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``prepared``'s step from ``table`` (the arena in the state it starts from)."""
        runtime = self.runner.runtime
        arena, backend = runtime.arena, runtime.backend
        arena.cover(table.placed.extent)
        if table.base != arena.base:
            table.base = arena.base
            table.pointers = tuple(None if op[0] != "run" else BindingLayout(tuple(table.base + o for o in op[2]), op[1].shapes)
                                   for op in table.ops)
        fetched: dict[str, np.ndarray] = {}
        for index, op in enumerate(table.ops):
            kind = op[0]
            try:
                if kind == "run":
                    self._run_block(op[1], table.pointers[index], op[3], prepared, backend)
                elif kind == "load":
                    arena.write_at(op[2], op[3], feeds[op[1]])
                else:
                    fetched[op[1]] = arena.read_at(op[2], op[3])
            except BaseException:
                for name in table.freed_state[index]:  # their bytes may hold other tensors now
                    arena.free(name)
                raise
        arena.adopt(table.placed.end, table.end_infos, table.end_token,
                    capacity=None if arena.growable else table.placed.end.capacity)
        if not table.keeps:
            runtime.state_version += 1
        return fetched

    def _run_block(self, layout, bound: BindingLayout, hosted: Mapping[str, int], prepared, backend) -> None:
        session = layout.session
        host_values = self.runner.host_values(prepared, session, self._reader(hosted, prepared)) if hosted else None
        try:
            session.run_at(bound[0], layout.shapes, prepared.infos, backend, host_values, layout=bound)
        except Exception as e:
            raise self.runner.block_failed(layout.block.index, e) from e

    def _reader(self, offsets: Mapping[str, int], prepared):
        arena, infos = self.runner.runtime.arena, prepared.infos
        return lambda name: arena.read_at(offsets[name], infos[name])
