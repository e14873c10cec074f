"""Swap planning (SwapAdvisor §4.2) over a lowered program: what leaves the arena, when, and
when it comes back.

The planner walks the program's steps tracking which tensors are resident and how many arena
bytes they take. When the tensors a step needs plus what it allocates would exceed the arena's
capacity, it evicts resident tensors the step does not touch, the one whose next use is
furthest in the future first (Belady), and brings each back right before its next use.
Eviction copies a tensor to the host unless the host already holds it (a tensor is an
immutable value: once copied, later evictions are drops). State (parameters, optimizer state,
buffers) may stay on the host between steps: an update evicted before the step ends makes its
state start the next step on the host; the plan is iterated until that set is stable.

Deciding is separate from applying: :class:`SwapPlanner` returns a frozen :class:`SwapPlan`,
:func:`apply_swap_plan` writes it into the program as ``SwapOut``/``SwapIn`` steps.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Mapping

from graph_passes.ir.program import Commit, Fetch, Load, Program, RunBlock, SwapIn, SwapOut

MAX_STEADY_STATE_ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class SwapPlan:
    """Where swap steps go: ``before[i]`` lists the swaps that run before program step ``i``
    (swap-outs first, then swap-ins); ``host_state`` starts each training step on the host."""

    before: tuple[tuple[int, tuple[SwapOut | SwapIn, ...]], ...]
    host_state: tuple[str, ...]
    capacity: int  # the budget planned for
    peak_in_use: int  # most live arena bytes plus running workspace
    swap_out_bytes: int
    swap_in_bytes: int

    @property
    def swap_count(self) -> int:
        return sum(len(swaps) for _, swaps in self.before)


@dataclasses.dataclass(frozen=True)
class Infeasible:
    """Why no plan fits: a step whose own inputs and outputs exceed the arena."""

    step: int
    needed_bytes: int
    reason: str


def required_bytes(program: Program, sizes: Mapping[str, int]) -> int:
    """The least budget any swap plan needs: the largest set of tensors one step must hold
    plus the workspace of that step's block."""
    return max(
        (sum(sizes[n] for n in _needs(program, step) | set(_allocates(step))) + _workspace(program, step)
         for step in program.steps),
        default=0,
    )


def step_requirements(program: Program, sizes: Mapping[str, int]) -> list[tuple[int, int]]:
    """(step index, bytes) for every step: the tensors it must hold and its block's workspace
    (what :func:`required_bytes` maximizes)."""
    return [(i, sum(sizes[n] for n in _needs(program, step) | set(_allocates(step))) + _workspace(program, step))
            for i, step in enumerate(program.steps)]


def blocks_over(program: Program, sizes: Mapping[str, int], budget: int) -> set[int]:
    """Blocks whose own inputs, outputs and workspace exceed ``budget``: no swap plan can run
    them (the per-block form of :func:`required_bytes`)."""
    return {
        step.block for step in program.steps
        if isinstance(step, RunBlock)
        and sum(sizes[n] for n in _needs(program, step) | set(_allocates(step))) + _workspace(program, step) > budget
    }


def _workspace(program: Program, step) -> int:
    return program.blocks[step.block].workspace_bytes if isinstance(step, RunBlock) else 0


class SwapPlanner:
    """Belady eviction with just-in-time swap-ins. Where the copies go in time is decided
    afterwards: :func:`graph_passes.planning.swap.eviction.issue_swap_outs_early` and
    :func:`graph_passes.planning.swap.prefetch.hoist_swap_ins` move them, :mod:`graph_passes.planning.swap.search`
    compares the results."""

    def plan(
        self, program: Program, sizes: Mapping[str, int], budget: int, *, host_state: Iterable[str] | None = None,
        priority: Mapping[str, int] | None = None,
    ) -> SwapPlan | Infeasible:
        """A plan keeping, at every step, live arena bytes plus the running block's workspace
        within ``budget``.

        ``host_state``: state tensors that live on the host between steps (each comes in when
        first needed and its update goes back to the host before the step ends). Other state
        is on the host between steps only where eviction puts its update (iterated to a steady
        state).

        ``priority``: per tensor, a victim class (default 0); lower classes are evicted first,
        Belady within a class (a search's keep/swap choice per tensor)."""
        need = required_bytes(program, sizes)
        if need > budget:
            return Infeasible(-1, need, "one step's inputs, outputs and workspace alone exceed the budget")
        capacity = budget
        forced = frozenset(host_state or ())
        unknown = forced - set(program.state_inputs)
        if unknown:
            raise ValueError(f"host_state names tensors that are not state inputs: {sorted(unknown)[:3]}")
        # The state on the host when a step starts must be what the previous step left there.
        host_start = forced
        for _ in range(MAX_STEADY_STATE_ROUNDS):
            plan, host_end = _plan_once(program, sizes, capacity, host_start, force_end=forced, priority=priority)
            if host_end == host_start:
                return plan
            if host_end < host_start:
                break  # state that started on the host ended on the device: send it back
            host_start = host_start | host_end  # grows monotonically, so this converges
        plan, _ = _plan_once(program, sizes, capacity, host_start, force_end=host_start, priority=priority)
        return plan


def _needs(program: Program, step) -> set[str]:
    if isinstance(step, RunBlock):
        return set(program.blocks[step.block].inputs)
    if isinstance(step, Fetch):
        return {step.name}
    return set()


def _allocates(step) -> tuple[str, ...]:
    if isinstance(step, RunBlock):
        return step.allocates
    if isinstance(step, Load):
        return (step.name,)
    return ()


def _frees(step) -> tuple[str, ...]:
    if isinstance(step, RunBlock):
        return step.frees
    if isinstance(step, Fetch) and step.free:
        return (step.name,)
    return ()


def _plan_once(program, sizes, capacity, host_start: frozenset, force_end: frozenset = frozenset(), priority=None):
    steps = program.steps
    renames: dict[str, str] = {}
    for step in steps:
        if isinstance(step, Commit):
            renames.update(dict(step.renames))  # updated output -> state input
    uses: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for name in _needs(program, step):
            uses.setdefault(name, []).append(i)
    horizon = len(steps)

    def next_use(name: str, after: int) -> float:
        positions = uses.get(name, [])
        k = bisect.bisect_right(positions, after)
        if k < len(positions):
            return positions[k]
        state = renames.get(name, name if name in program.state_inputs else None)
        if state is not None and uses.get(state):
            return horizon + uses[state][0]  # used again next step
        return float("inf")

    resident = {n for n in program.state_inputs if n not in host_start}
    on_host = set(host_start)
    in_use = sum(sizes[n] for n in resident)
    before: dict[int, list] = {}
    peak = in_use
    swapped_out = swapped_in = 0
    for i, step in enumerate(steps):
        needed = _needs(program, step)
        allocs = _allocates(step)
        ins = sorted(n for n in needed if n not in resident)
        limit = capacity - _workspace(program, step)
        demand = in_use + sum(sizes[n] for n in ins) + sum(sizes[n] for n in allocs)
        outs = []
        if demand > limit:
            pinned = needed | set(allocs)
            rank = priority or {}
            candidates = sorted((n for n in resident if n not in pinned), key=lambda n: (rank.get(n, 0), -next_use(n, i), n))
            for victim in candidates:
                if demand <= limit:
                    break
                copy = victim not in on_host
                outs.append(SwapOut(victim, copy=copy))
                swapped_out += sizes[victim] if copy else 0
                resident.discard(victim)
                on_host.add(victim)
                in_use -= sizes[victim]
                demand -= sizes[victim]
        for name in ins:
            resident.add(name)
            in_use += sizes[name]
            swapped_in += sizes[name]
        if outs or ins:
            before[i] = outs + [SwapIn(n) for n in ins]
        for name in allocs:
            resident.add(name)
            in_use += sizes[name]
        peak = max(peak, in_use + _workspace(program, step))
        for name in _frees(step):
            resident.discard(name)
            on_host.discard(name)
            in_use -= sizes[name]
    # What holds each state tensor when the step ends: its update, or itself if nothing replaces it.
    holder = {state: updated for updated, state in renames.items()}
    holder.update({n: n for n in program.state_inputs if n not in holder})
    # State that must end on the host (to start the next step there) although it stayed resident.
    extra = [SwapOut(holder[s], copy=holder[s] not in on_host) for s in sorted(force_end) if holder[s] in resident]
    if extra:
        end = next((i for i, step in enumerate(steps) if isinstance(step, Commit)), len(steps))
        before.setdefault(end, []).extend(extra)
        for swap in extra:
            resident.discard(swap.name)
            on_host.add(swap.name)
            swapped_out += sizes[swap.name] if swap.copy else 0
    host_end = frozenset(state for state, value in holder.items() if value not in resident)
    plan = SwapPlan(
        before=tuple((i, tuple(swaps)) for i, swaps in sorted(before.items())),
        host_state=tuple(n for n in program.state_inputs if n in host_start),
        capacity=capacity,
        peak_in_use=peak,
        swap_out_bytes=swapped_out,
        swap_in_bytes=swapped_in,
    )
    return plan, host_end


def apply_swap_plan(program: Program, plan: SwapPlan) -> Program:
    """The program with the plan's swap steps inserted and host-resident state moved out of
    the arena's initial placement."""
    before = dict(plan.before)
    steps = []
    for i, step in enumerate(program.steps):
        steps.extend(before.get(i, ()))
        steps.append(step)
    steps.extend(before.get(len(program.steps), ()))
    host = set(plan.host_state)
    return dataclasses.replace(
        program,
        steps=tuple(steps),
        state_inputs=tuple(n for n in program.state_inputs if n not in host),
        host_state=tuple(n for n in program.state_inputs if n in host),
    )


def placed_plan(plan: SwapPlan, placed: Program) -> SwapPlan:
    """``plan`` with its swaps at the positions they have in ``placed`` (the plan applied,
    then its swap-outs issued early and its swap-ins hoisted): what a pass writes into the
    graph, so a rewritten graph runs the swaps where the runtime would."""
    before: dict[int, tuple] = {}
    index, pending = 0, []
    for step in placed.steps:
        if isinstance(step, (SwapOut, SwapIn)):
            pending.append(step)
            continue
        if pending:
            before[index], pending = tuple(pending), []
        index += 1
    if pending:
        before[index] = tuple(pending)
    return dataclasses.replace(plan, before=tuple(sorted(before.items())))
