"""Swap planning (SwapAdvisor §4.2) over a lowered program: what leaves the arena, when, and
when it comes back.

The planner walks the program's steps tracking which tensors are resident and how many arena
bytes they take. When the tensors a step needs plus what it allocates would exceed the arena's
capacity, it evicts resident tensors the step does not touch, the one whose next use is
furthest in the future first (Belady; or clean first: those the host already holds, which leave
without a copy, before the rest, Belady within each), and brings each back right before its
next use.
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

# Victim orders under memory pressure. Belady: the furthest next use first. Clean first: tensors
# the host already holds (a value swapped in and not replaced since, a clean state input) before
# those that need a copy out, Belady within each; dropping a clean tensor frees its room at
# once, where a dirty one holds it until its copy out ends (the stall behind copies out on a
# copy link).
EVICT_BELADY, EVICT_CLEAN_FIRST = "belady", "clean_first"
EVICTION_ORDERS = (EVICT_BELADY, EVICT_CLEAN_FIRST)


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
    eviction: str = EVICT_BELADY  # the victim order that made it (EVICTION_ORDERS)

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
    """Belady (or clean-first) eviction with just-in-time swap-ins. Where the copies go in time
    is decided afterwards: :func:`graph_passes.planning.swap.eviction.issue_swap_outs_early` and
    :func:`graph_passes.planning.swap.prefetch.hoist_swap_ins` move them, :mod:`graph_passes.planning.swap.search`
    compares the results."""

    def plan(
        self, program: Program, sizes: Mapping[str, int], budget: int, *, host_state: Iterable[str] | None = None,
        priority: Mapping[str, int] | None = None, eviction: str = EVICT_BELADY,
    ) -> SwapPlan | Infeasible:
        """A plan keeping, at every step, live arena bytes plus the running block's workspace
        within ``budget``.

        ``host_state``: state tensors that live on the host between steps (each comes in when
        first needed and its update goes back to the host before the step ends). Other state
        is on the host between steps only where eviction puts its update (iterated to a steady
        state).

        ``priority``: per tensor, a victim class (default 0); lower classes are evicted first,
        Belady within a class (a search's keep/swap choice per tensor).

        ``eviction``: :data:`EVICT_BELADY` or :data:`EVICT_CLEAN_FIRST`, the order within a
        priority class (see :data:`EVICTION_ORDERS`)."""
        if eviction not in EVICTION_ORDERS:
            raise ValueError(f"unknown eviction order {eviction!r}: use {', '.join(EVICTION_ORDERS)}")
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
        clean_first = eviction == EVICT_CLEAN_FIRST
        for _ in range(MAX_STEADY_STATE_ROUNDS):
            once = _plan_once(program, sizes, capacity, host_start, force_end=forced, priority=priority,
                              clean_first=clean_first)
            if once.host_end == host_start:
                return once.plan
            if once.host_end < host_start:
                break  # state that started on the host ended on the device: send it back
            host_start = host_start | once.host_end  # grows monotonically, so this converges
        return _plan_once(program, sizes, capacity, host_start, force_end=host_start, priority=priority,
                          clean_first=clean_first).plan


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


@dataclasses.dataclass(frozen=True)
class _OnePlan:
    """One eviction walk's plan, and the state on the host when its step ends."""

    plan: SwapPlan
    host_end: frozenset[str]


def _plan_once(program, sizes, capacity, host_start: frozenset, force_end: frozenset = frozenset(),
               priority=None, clean_first: bool = False) -> _OnePlan:
    """One eviction walk over the steps, starting with ``host_start`` on the host and ending
    with the state in ``force_end`` on the host; ``clean_first``: the clean-first victim order."""
    next_use = _NextUse(program)
    walk = _EvictionWalk(program, sizes, host_start, clean_first=clean_first)
    for i, step in enumerate(program.steps):
        walk.step(i, step, capacity - _workspace(program, step), next_use, priority or {})
    # What holds each state tensor when the step ends: its update, or itself if nothing replaces it.
    holder = {state: updated for updated, state in next_use.renames.items()}
    holder.update({n: n for n in program.state_inputs if n not in holder})
    walk.send_to_host_at_end(holder, force_end)
    host_end = frozenset(state for state, value in holder.items() if value not in walk.resident)
    plan = SwapPlan(
        before=tuple((i, tuple(swaps)) for i, swaps in sorted(walk.before.items())),
        host_state=tuple(n for n in program.state_inputs if n in host_start),
        capacity=capacity,
        peak_in_use=walk.peak,
        swap_out_bytes=walk.swapped_out,
        swap_in_bytes=walk.swapped_in,
        eviction=EVICT_CLEAN_FIRST if clean_first else EVICT_BELADY,
    )
    return _OnePlan(plan, host_end)


class _NextUse:
    """Belady's distance: the program step of a tensor's next use after a step; state (or its
    update) is used again by the next training step, at ``len(steps)`` plus its first use."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.renames: dict[str, str] = {}  # updated output -> state input
        for step in program.steps:
            if isinstance(step, Commit):
                self.renames.update(dict(step.renames))
        self.uses: dict[str, list[int]] = {}
        for i, step in enumerate(program.steps):
            for name in _needs(program, step):
                self.uses.setdefault(name, []).append(i)
        self.horizon = len(program.steps)

    def __call__(self, name: str, after: int) -> float:
        positions = self.uses.get(name, [])
        k = bisect.bisect_right(positions, after)
        if k < len(positions):
            return positions[k]
        state = self.renames.get(name, name if name in self.program.state_inputs else None)
        if state is not None and self.uses.get(state):
            return self.horizon + self.uses[state][0]  # used again next step
        return float("inf")


class _EvictionWalk:
    """What the walk tracks: the resident tensors and their bytes, which tensors the host holds,
    the swaps placed before each step, the peak and the bytes copied each way."""

    def __init__(self, program: Program, sizes: Mapping[str, int], host_start: frozenset,
                 clean_first: bool = False) -> None:
        self.program, self.sizes, self.clean_first = program, sizes, clean_first
        self.resident = {n for n in program.state_inputs if n not in host_start}
        self.on_host = set(host_start)
        self.in_use = sum(sizes[n] for n in self.resident)
        self.before: dict[int, list] = {}
        self.peak = self.in_use
        self.swapped_out = self.swapped_in = 0

    def step(self, i: int, step, limit: int, next_use: _NextUse, rank: Mapping[str, int]) -> None:
        """Make room for step ``i`` within ``limit`` (the capacity less its workspace), bring
        in what it needs, then account for what it allocates and frees."""
        sizes = self.sizes
        needed = _needs(self.program, step)
        allocs = _allocates(step)
        ins = sorted(n for n in needed if n not in self.resident)
        demand = self.in_use + sum(sizes[n] for n in ins) + sum(sizes[n] for n in allocs)
        outs = []
        if demand > limit:
            pinned = needed | set(allocs)
            candidates = sorted((n for n in self.resident if n not in pinned),
                                key=lambda n: (rank.get(n, 0), self.clean_first and n not in self.on_host,
                                               -next_use(n, i), n))
            outs = self._evict(candidates, demand, limit)
        for name in ins:
            self.resident.add(name)
            self.in_use += sizes[name]
            self.swapped_in += sizes[name]
        if outs or ins:
            self.before[i] = outs + [SwapIn(n) for n in ins]
        for name in allocs:
            self.resident.add(name)
            self.in_use += sizes[name]
        self.peak = max(self.peak, self.in_use + _workspace(self.program, step))
        for name in _frees(step):
            self.resident.discard(name)
            self.on_host.discard(name)
            self.in_use -= sizes[name]

    def _evict(self, candidates: list[str], demand: int, limit: int) -> list[SwapOut]:
        """Swap out ``candidates`` in order until ``demand`` fits ``limit``."""
        outs = []
        for victim in candidates:
            if demand <= limit:
                break
            copy = victim not in self.on_host
            outs.append(SwapOut(victim, copy=copy))
            self.swapped_out += self.sizes[victim] if copy else 0
            self.resident.discard(victim)
            self.on_host.add(victim)
            self.in_use -= self.sizes[victim]
            demand -= self.sizes[victim]
        return outs

    def send_to_host_at_end(self, holder: Mapping[str, str], force_end: frozenset) -> None:
        """Swap out, before the commit, the state of ``force_end`` that stayed resident (so it
        starts the next step on the host)."""
        extra = [SwapOut(holder[s], copy=holder[s] not in self.on_host) for s in sorted(force_end)
                 if holder[s] in self.resident]
        if not extra:
            return
        steps = self.program.steps
        end = next((i for i, step in enumerate(steps) if isinstance(step, Commit)), len(steps))
        self.before.setdefault(end, []).extend(extra)
        for swap in extra:
            self.resident.discard(swap.name)
            self.on_host.add(swap.name)
            self.swapped_out += self.sizes[swap.name] if swap.copy else 0


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
