"""Genetic search over swap plans (SwapAdvisor §5): schedule, block cuts, state placement and a
per-tensor keep/swap/recompute choice, scored by the simulator, the budget checked by the arena replay.

A :class:`Genome` holds

- **schedule**: a topological order of the nodes. Crossover is SwapAdvisor's (Sinnen's): a
  prefix of one parent, then the other nodes in the other parent's order; mutation is its
  ready-set walk (with probability ``p`` a random ready node, else the one first in the
  parent), plus moves of one node to the latest place before its first reader. Every child is
  topological. Nodes that must stay last (order-dependent ones and their readers) stay there.
- **cuts**: schedule positions where a new execution block starts.
- **host_state**: state tensors kept on the host between steps.
- **eviction**: the planner's victim order within a class, Belady or clean first
  (:data:`~graph_passes.planning.swap.planner.EVICTION_ORDERS`).
- **choices**: per tensor, keep, swap or recompute. ``SWAP`` tensors leave first under memory
  pressure, ``KEEP`` tensors last (the Belady planner's classes: :meth:`SwapPlanner.plan`'s
  ``priority``); ``RECOMPUTE`` (where the space allows it, :attr:`SearchSpace.recompute`) drops a
  saved forward value after its last forward use and re-creates it before its backward use
  from what is there then (the graph rewritten by the caller's :class:`Variant`; the schedule
  and cuts, genes of the given graph, are mapped onto the rewrite, each clone right before its
  first reader). Any set of recomputed tensors is valid, so crossover and mutation need no repair.

No memory-layout gene: SwapAdvisor's size classes (CLS/CNT) describe its pool allocator; our
arena is best-fit with compaction, whose need is the live bytes
(:func:`graph_passes.ir.memory.simulate_program`), so a layout gene would not change any plan's
feasibility or time. Whole-segment recomputation is chosen one level up: the step planner plans
its recompute-and-swap candidates first and hands the GA the winner's graph
(:meth:`graph_passes.planning.driver.StepPlanner.refine`), whose saved values the recompute
genes then choose from. The first generation also tries the seed with the other victim order,
the batch-independent small nodes moved (:meth:`_Operators.independent_spread`) and, where
recompute genes apply, the tensors cheaper to recompute than to copy by several margins
(:data:`RECOMPUTE_RATIOS`).

A genome is decoded as the grid search decodes its candidates (:mod:`graph_passes.planning.swap.search`):
lowered, Belady-planned, swap-outs issued early, swap-ins hoisted, replayed through the arena
(infeasible if over the budget), then timed by ``evaluate``. The population starts from the
grid's best plan, kept as is, so the result is never slower than it. Selection keeps the best
(elitism) and picks parents by tournament: SwapAdvisor's softmax over normalised times (its
Eq. 1) barely prefers the best with a population this small. A generation's children are timed
side by side in forked workers (:mod:`graph_passes.planning.swap.evaluation`, ``GAConfig.workers``).
Random choices come from one ``random.Random(seed)``: the same seed and the same number of
evaluations give the same plan, with any number of workers;
the time limit stops the search where it is and returns the best so far. A search that has
converged (12 generations without a better plan) starts again from its best plan alone, with
the first generation's seeds made from it, up to ``restarts`` times: the evaluations and time a
converged search would leave unused go to escaping its local optimum. Unless the time ran
out, a last polish (:meth:`GeneticSwapSearch._lead_polish`) pulls batch-independent nodes that
read no host-kept state to the front of the best schedule, 1, 2, 4, ... more while that is faster:
they run while the batch loads, which the first block reading it waits for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from typing import Callable, Mapping, Sequence

import onnx
import onnx_ir.passes

from graph_passes.planning.swap.evaluation import Evaluator, step_time_of
from graph_passes.planning.swap.eviction import issue_swap_outs_early
from graph_passes.ir.liveness import node_io
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.memory import least_budget_bytes
from graph_passes.planning.swap.prefetch import hoist_swap_ins
from graph_passes.planning.workers import default_workers
from graph_passes.ir.program import Program, order_dependent_closure, program_order
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.swap.planner import EVICT_BELADY, EVICTION_ORDERS, Infeasible, SwapPlanner, apply_swap_plan
from graph_passes.planning.swap.search import SwapCandidate

logger = logging.getLogger(__name__)

DEFAULT_PLAN_TIME_S = 30.0  # the issue's limit is 60 s; most gains come in the first generations
SWAP, DEFAULT, KEEP, RECOMPUTE = -1, 0, 1, 2
# First-generation recompute genes: the tensors whose re-creation costs less than this share of
# their copies out and back in.
RECOMPUTE_RATIOS = (1.0, 0.3, 0.1)
VARIANTS_KEPT = 16  # rewritten graphs kept for reuse during one search
GA_LABEL = "ga"


@dataclasses.dataclass(frozen=True)
class GAConfig:
    """Search settings (keyword-only knobs; defaults tuned on gpt and cnn small)."""

    time_limit_s: float = DEFAULT_PLAN_TIME_S
    seed: int = 0
    population: int = 8
    children: int = 6  # per generation
    max_evaluations: int | None = None  # a hard count (deterministic whatever the machine's speed)
    stale_generations: int = 12  # stop after this many generations without a better plan
    restarts: int = 8  # then start again from the best plan alone, this many times at most
    schedule_p: float = 0.02  # ready-set mutation: chance of a random pick
    gene_tensors: int = 96  # largest swapped or swappable tensors that carry a keep/swap gene
    workers: int | None = None  # processes timing genomes side by side (None: default_workers())


@dataclasses.dataclass(frozen=True)
class Genome:
    schedule: tuple[int, ...]
    cuts: frozenset[int]  # schedule positions starting a block (0 excluded)
    host_state: frozenset[str]
    choices: tuple[tuple[str, int], ...]  # (tensor, SWAP | KEEP | RECOMPUTE); absent: DEFAULT
    eviction: str = EVICT_BELADY  # the planner's victim order within a class (EVICTION_ORDERS)

    @property
    def recomputed(self) -> frozenset[str]:
        return frozenset(t for t, c in self.choices if c == RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Variant:
    """The searched graph with some tensors recomputed: the rewrite, its infos, how many nodes
    it added, and how a schedule and cuts *of the searched graph* lower it and it is timed."""

    model: onnx.ModelProto
    infos: Mapping[str, TensorInfo]
    added_nodes: int
    rewrite: onnx_ir.passes.PassBase  # writes the recomputes into the searched graph (a plan's rewrites)
    lower: Callable[[Sequence[int], Sequence[int]], Program]
    evaluate: Callable[[Program], float]


@dataclasses.dataclass(frozen=True)
class GAResult:
    """The best plan found, and how the search went."""

    best: SwapCandidate
    genome: Genome | None  # None: the seed (grid) plan stayed best
    seed_step_time_s: float
    generations: int
    evaluations: int
    feasible: int  # evaluations within the budget
    time_s: float
    stopped: str  # "time", "evaluations" or "converged"
    history: tuple[float, ...]  # best step time after each generation
    variant: Variant | None = None  # the best plan's rewritten graph (None: the searched graph)
    lead_evaluations: int = 0  # evaluations of the lead polish after the search (not in ``evaluations``)

    @property
    def improved(self) -> bool:
        return self.genome is not None


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What decoding a genome needs from the caller."""

    model: onnx.ModelProto
    infos: Mapping[str, TensorInfo]
    budget: int
    lower: Callable[[Sequence[int], Sequence[int]], Program]  # (schedule, cuts) -> program
    evaluate: Callable[[Program], float]  # simulated step time
    alignment: int = DEFAULT_ALIGNMENT
    # Recompute genes: the graph with these saved values recomputed (None: no recompute genes),
    # and per recomputable tensor its re-creation time over its copy time (for the first generation).
    recompute: Callable[[frozenset[str]], Variant] | None = None
    recompute_ratio: Mapping[str, float] = dataclasses.field(default_factory=dict)


def seed_genome(candidate: SwapCandidate, model: onnx.ModelProto) -> Genome:
    """The genome of a grid plan of ``model``: its schedule (every node, those no block runs
    included: :func:`~graph_passes.ir.program.program_order`), block starts, host state and
    victim order."""
    blocks = candidate.base_program.blocks
    schedule = program_order(model, candidate.base_program)
    position = {node: k for k, node in enumerate(schedule)}
    cuts = frozenset(position[b.node_indices[0]] for b in blocks[1:] if b.node_indices)
    return Genome(tuple(schedule), cuts, frozenset(candidate.plan.host_state), (), candidate.plan.eviction)


def decode(genome: Genome, space: SearchSpace, planner: SwapPlanner | None = None,
           variant: Variant | None = None) -> SwapCandidate | None:
    """The plan a genome stands for, timed; None if it does not fit the budget, or if its
    schedule is not an order the graph can run in (moves can produce one on split graphs,
    whose split pieces read each other's partial results). ``variant``: the graph with the
    genome's recomputed tensors recomputed (the searched graph itself where None)."""
    planner = planner or SwapPlanner()
    lower, evaluate, infos = ((space.lower, space.evaluate, space.infos) if variant is None
                              else (variant.lower, variant.evaluate, variant.infos))
    try:
        program = lower(genome.schedule, tuple(sorted(genome.cuts)))
    except ValueError:  # graph_passes.ir.liveness.check_topological
        return None
    sizes = {n: align_up(i.nbytes, space.alignment) for n, i in infos.items()}
    host = genome.host_state & set(program.state_inputs)
    priority = {t: c for t, c in genome.choices if c != RECOMPUTE}
    plan = planner.plan(program, sizes, space.budget, host_state=host, priority=priority, eviction=genome.eviction)
    if isinstance(plan, Infeasible):
        return None
    placed = hoist_swap_ins(issue_swap_outs_early(apply_swap_plan(program, plan)), infos,
                            budget=space.budget, alignment=space.alignment)
    if least_budget_bytes(placed, infos, budget=space.budget, alignment=space.alignment) > space.budget:
        return None
    return SwapCandidate(program, plan, placed, None, GA_LABEL, evaluate(placed))  # the kept plan's trace: refine_swap_plan


class _Variants:
    """The space's rewrites by recomputed set, the last :data:`VARIANTS_KEPT` kept."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.kept: dict[frozenset[str], Variant] = {}

    def __call__(self, recomputed: frozenset[str]) -> Variant | None:
        if not recomputed or self.space.recompute is None:
            return None
        if recomputed not in self.kept:
            if len(self.kept) >= VARIANTS_KEPT:
                del self.kept[next(iter(self.kept))]
            self.kept[recomputed] = self.space.recompute(recomputed)
        return self.kept[recomputed]


class _Operators:
    """Crossover and mutation over one graph's genomes."""

    def __init__(self, model: onnx.ModelProto, seed: Genome, seed_plan: Program, state: Sequence[str],
                 rng: random.Random, config: GAConfig, sizes: Mapping[str, int],
                 recomputable: Mapping[str, float] | None = None) -> None:
        """``recomputable``: the tensors that may carry a recompute gene, each with its
        re-creation time over its copy time (none: no recompute genes)."""
        self.rng, self.config = rng, config
        self.recompute_ratio = dict(recomputable or {})
        self.recomputable = tuple(sorted(self.recompute_ratio, key=lambda t: (self.recompute_ratio[t], t)))
        io = node_io(model.graph.node)
        producer = {name: i for i, entry in enumerate(io) for name in entry.outputs}
        self.preds = [sorted({producer[n] for n in entry.reads if n in producer}) for entry in io]
        self.reads = [frozenset(entry.reads) for entry in io]
        self.succs: list[list[int]] = [[] for _ in io]
        for i, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(i)
        late = order_dependent_closure(list(model.graph.node), io, seed.schedule)
        # The schedule genes reorder the nodes before the first order-dependent one; from there
        # on (those nodes and whatever the seed runs between them, e.g. state updates) the seed's
        # order stays. Nothing before that point reads anything after it.
        self.movable = min((k for k, n in enumerate(seed.schedule) if n in late), default=len(seed.schedule))
        self.state = tuple(sorted(state))
        swapped = {s.name for s in seed_plan.steps if hasattr(s, "copy")}
        values = {n for b in seed_plan.blocks for n in b.outputs} | set(seed_plan.state_inputs)
        ranked = sorted(values, key=lambda n: (n not in swapped, -sizes.get(n, 0), n))
        self.gene_tensors = tuple(ranked[: config.gene_tensors])
        self.independent = _batch_independent(io, seed_plan.data_inputs, sizes, producer)
        self.fetch_producers = frozenset(producer[n] for n in seed_plan.fetches if n in producer)

    def independent_spread(self, g: Genome, span: str) -> Genome:
        """The genome with the nodes that do not depend on the batch and make only small values
        (optimizer scalars: step counts, bias corrections) moved: ``span`` "first" runs them
        before everything, "forward" spreads them evenly over the forward (up to the first
        fetch), "step" over the whole step. Compute that can fill the time the forward waits for
        its copies out of the device. Each still runs before its first reader."""
        prefix = g.schedule[: self.movable]
        moved = [n for n in prefix if n in self.independent]
        rest = [n for n in prefix if n not in self.independent]
        rank = {n: k for k, n in enumerate(moved)}
        end = 0 if span == "first" else next(
            (k for k, n in enumerate(rest) if n in self.fetch_producers), len(rest)) if span == "forward" else len(rest)
        out, placed = [], 0
        for j, node in enumerate(rest):
            quota = len(moved) if j >= end else (len(moved) * j) // max(1, end)
            quota = max(quota, 1 + max((rank[p] for p in self.preds[node] if p in rank), default=-1))
            out.extend(moved[placed:quota])
            placed = max(placed, quota)
            out.append(node)
        out.extend(moved[placed:])
        schedule = tuple(out) + g.schedule[self.movable:]
        return dataclasses.replace(g, schedule=schedule, cuts=_cuts_by_node(g, schedule, self.independent))

    def lead_more(self, g: Genome, count: int = 1) -> Genome:
        """The first ``count`` batch-independent nodes in ``g``'s schedule that read no state
        kept on the host (nor depend on one that does) and are not yet in the run of such nodes
        that starts the schedule, moved with their producers to the end of that run: compute
        with nothing to copy in, run while the batch loads (the first block reading it waits for
        its copy). ``g`` itself where there is none."""
        chosen = self._reading_no_host_state(g.host_state)
        order = list(g.schedule[: self.movable])
        lead = next((k for k, n in enumerate(order) if n not in chosen), len(order))
        pool = [n for n in order[lead:] if n in chosen]
        if not pool:
            return g
        leading, pulled, stack = set(order[:lead]), set(), pool[:count]
        while stack:
            node = stack.pop()
            if node not in pulled and node not in leading:
                pulled.add(node)
                stack.extend(self.preds[node])
        rest = [n for n in order if n not in pulled]
        schedule = tuple(rest[:lead] + [n for n in order if n in pulled] + rest[lead:]) + g.schedule[self.movable:]
        return dataclasses.replace(g, schedule=schedule, cuts=_cuts_by_node(g, schedule, frozenset(leading | pulled)))

    def _reading_no_host_state(self, host_state: frozenset[str]) -> frozenset[int]:
        """The batch-independent nodes none of whose reads, nor their batch-independent
        producers' reads, is in ``host_state``."""
        chosen: set[int] = set()
        for node in sorted(self.independent):  # graph order is topological
            if not any(name in host_state for name in self.reads[node]) and all(
                    p in chosen for p in self.preds[node] if p in self.independent):
                chosen.add(node)
        return frozenset(chosen)

    def crossover(self, a: Genome, b: Genome) -> Genome:
        rng = self.rng
        schedule = a.schedule
        if self.movable > 1:
            cr = rng.randrange(1, self.movable)
            prefix = b.schedule[:cr]
            taken = set(prefix)
            schedule = prefix + tuple(n for n in a.schedule if n not in taken)
        split = rng.randrange(1, max(2, len(schedule)))
        cuts = frozenset(c for c in b.cuts if c < split) | frozenset(c for c in a.cuts if c >= split)
        host = frozenset(s for s in self.state if (s in a.host_state if rng.random() < 0.5 else s in b.host_state))
        va, vb = dict(a.choices), dict(b.choices)
        choices = {t: (va if rng.random() < 0.5 else vb).get(t, DEFAULT) for t in sorted(set(va) | set(vb))}
        eviction = (a if rng.random() < 0.5 else b).eviction
        return Genome(schedule, cuts, host, _choices(choices), eviction)

    def mutate(self, g: Genome) -> Genome:
        rng = self.rng
        kinds = ("schedule", "sink", "cuts", "cuts", "host", "choices", "choices", "eviction")
        kind = rng.choice(kinds + (("recompute", "recompute") if self.recomputable else ()))
        if kind == "schedule" and self.movable > 1:
            return dataclasses.replace(g, schedule=self._ready_walk(g.schedule))
        if kind == "sink" and self.movable > 1:
            return dataclasses.replace(g, schedule=self._sink(g.schedule))
        if kind == "cuts" or (kind in ("schedule", "sink")):
            return dataclasses.replace(g, cuts=self._mutate_cuts(g.cuts, len(g.schedule)))
        if kind == "host" and self.state:
            flips = set(rng.sample(self.state, k=max(1, len(self.state) // 16)))
            return dataclasses.replace(g, host_state=g.host_state ^ flips)
        if kind == "recompute":
            return self._toggle_recompute(g)
        if kind == "eviction":
            return self.other_eviction(g)
        choices = dict(g.choices)
        for t in rng.sample(self.gene_tensors, k=min(len(self.gene_tensors), 1 + rng.randrange(4))):
            choices[t] = rng.choice((SWAP, DEFAULT, KEEP, RECOMPUTE) if t in self.recompute_ratio else (SWAP, DEFAULT, KEEP))
        return dataclasses.replace(g, choices=_choices(choices))

    @staticmethod
    def other_eviction(g: Genome) -> Genome:
        """``g`` with the planner's other victim order (Belady or clean first)."""
        return dataclasses.replace(g, eviction=next(o for o in EVICTION_ORDERS if o != g.eviction))

    def _toggle_recompute(self, g: Genome) -> Genome:
        """A few recomputable tensors switched between recomputed and not: those switched on
        drawn with a preference for the cheaper to recompute (the first half of the list by
        ratio twice as often), those switched off among the recomputed."""
        rng, choices = self.rng, dict(g.choices)
        for _ in range(1 + rng.randrange(3)):
            on = sorted(t for t, c in choices.items() if c == RECOMPUTE)
            if on and rng.random() < 0.4:
                choices[rng.choice(on)] = DEFAULT
                continue
            half = max(1, len(self.recomputable) // 2)
            pool = self.recomputable[:half] if rng.random() < 0.5 else self.recomputable
            choices[rng.choice(pool)] = RECOMPUTE
        return dataclasses.replace(g, choices=_choices(choices))

    def recompute_cheaper(self, g: Genome, ratio: float) -> Genome:
        """``g`` with every tensor whose re-creation costs less than ``ratio`` times its copies
        recomputed."""
        choices = dict(g.choices)
        choices.update((t, RECOMPUTE) for t in self.recomputable if self.recompute_ratio[t] < ratio)
        return dataclasses.replace(g, choices=_choices(choices))

    def _ready_walk(self, schedule: tuple[int, ...]) -> tuple[int, ...]:
        """SwapAdvisor's schedule mutation over the movable prefix."""
        rng, p = self.rng, self.config.schedule_p
        prefix = schedule[: self.movable]
        rank = {n: k for k, n in enumerate(prefix)}
        waiting = {n: sum(1 for q in self.preds[n] if q in rank) for n in prefix}
        ready = sorted((rank[n], n) for n in prefix if waiting[n] == 0)
        out: list[int] = []
        while ready:
            k = rng.randrange(len(ready)) if rng.random() < p else 0
            _, n = ready.pop(k)
            out.append(n)
            for s in self.succs[n]:
                if s in waiting:
                    waiting[s] -= 1
                    if waiting[s] == 0:
                        ready.append((rank[s], s))
                        ready.sort()
        return tuple(out) + schedule[self.movable:]

    def _sink(self, schedule: tuple[int, ...]) -> tuple[int, ...]:
        """One node moved to right before its first reader (its outputs live shorter), or right
        after its last input's producer (copies of what it reads can start sooner)."""
        rng = self.rng
        order = list(schedule[: self.movable])
        position = {n: k for k, n in enumerate(order)}
        k = rng.randrange(len(order))
        node = order[k]
        if rng.random() < 0.5:
            target = min((position[s] for s in self.succs[node] if s in position), default=len(order)) - 1
        else:
            target = max((position[q] for q in self.preds[node] if q in position), default=-1) + 1
        order.pop(k)
        order.insert(target, node)
        return tuple(order) + schedule[self.movable:]

    def _mutate_cuts(self, cuts: frozenset[int], n: int) -> frozenset[int]:
        rng, cuts = self.rng, set(cuts)
        for _ in range(1 + rng.randrange(8)):
            action = rng.random()
            if action < 0.4 or not cuts:
                cuts.add(rng.randrange(1, max(2, n)))
            elif action < 0.8:
                cuts.discard(rng.choice(sorted(cuts)))
            else:
                c = rng.choice(sorted(cuts))
                cuts.discard(c)
                cuts.add(min(max(1, c + rng.choice((-2, -1, 1, 2))), max(1, n - 1)))
        return frozenset(c for c in cuts if 0 < c < n)


def _cuts_by_node(g: Genome, schedule: tuple[int, ...], alone: frozenset[int]) -> frozenset[int]:
    """``g``'s block starts (at the same nodes) in ``schedule``, and the runs of ``alone``
    nodes in blocks of their own (so they never wait with a block that waits for memory)."""
    position = {n: k for k, n in enumerate(schedule)}
    cuts = {position[g.schedule[c]] for c in g.cuts}
    cuts.update(k for k in range(1, len(schedule)) if (schedule[k] in alone) != (schedule[k - 1] in alone))
    return frozenset(cuts)


LEAD_POLISH = 6  # evaluations after the search that pull batch-independent nodes to the start
SMALL_VALUE_BYTES = 4096  # what independent_first moves: nodes whose every output is at most this


def _batch_independent(io, data_inputs, sizes: Mapping[str, int], producer: Mapping[str, int]) -> frozenset[int]:
    """Nodes that read no value derived from the batch, make only values of at most
    :data:`SMALL_VALUE_BYTES`, and whose producers of what they read are such nodes too."""
    derived = set(data_inputs)
    chosen: set[int] = set()
    for i, entry in enumerate(io):  # the graph's node order is topological
        if any(name in derived for name in entry.reads):
            derived.update(entry.outputs)
            continue
        small = all(sizes.get(name, 0) <= SMALL_VALUE_BYTES for name in entry.outputs)
        if small and all(producer[name] in chosen for name in entry.reads if name in producer):
            chosen.add(i)
    return frozenset(chosen)


def _choices(classes: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((t, c) for t, c in classes.items() if c != DEFAULT))


class GeneticSwapSearch:
    """SwapAdvisor's GA over our plan space (module docstring), seeded with a grid plan."""

    def __init__(self, config: GAConfig | None = None, *, planner: SwapPlanner | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config or GAConfig()
        self.planner = planner or SwapPlanner()
        self.clock = clock

    def search(self, seed: SwapCandidate, space: SearchSpace, others: Sequence[SwapCandidate] = ()) -> GAResult:
        """The fastest plan found within the time limit, never slower than ``seed``. ``others``
        (more plans of the same graph: the other grid schedules' best) are evaluated in the
        first generation, so the search starts from more than one schedule."""
        cfg, start = self.config, self.clock()
        rng = random.Random(cfg.seed)
        first = seed_genome(seed, space.model)
        extra = [seed_genome(other, space.model) for other in others]
        sizes = {n: align_up(i.nbytes, space.alignment) for n, i in space.infos.items()}
        ops = _Operators(space.model, first, seed.base_program, seed.base_program.state_inputs, rng, cfg, sizes,
                         space.recompute_ratio if space.recompute is not None else None)
        variants = _Variants(space)
        scored: dict[Genome, float] = {first: seed.step_time_s}  # simulated step time; inf: does not fit
        population: list[Genome] = [first]
        best, best_genome = seed, None
        history, generations, stale = [], 0, 0
        tally = _Tally(cfg, self.clock, start)
        with Evaluator(lambda g: self._decode(g, space, variants), cfg.workers or default_workers()) as evaluator:
            restarts = cfg.restarts
            while stale < cfg.stale_generations or restarts > 0:
                if stale >= cfg.stale_generations:  # converged: start again from the best alone
                    restarts, stale, population = restarts - 1, 0, [best_genome or first]
                children = self._children(population, scored, ops, fill=len(population) < cfg.population,
                                          extra=extra if generations == 0 else ())
                decoded = self._evaluate(children, scored, evaluator, tally)
                population = self._select({g for g in (*population, *children) if g in scored}, scored)
                generations += 1
                top = population[0]
                if scored[top] < best.step_time_s:
                    best, best_genome, stale = decoded.get(top) or self._decode(top, space, variants), top, 0
                else:
                    stale += 1
                history.append(best.step_time_s)
                if tally.stopped != "converged":
                    break
        polished = 0
        if tally.stopped != "time":
            best, best_genome, polished = self._lead_polish(
                best_genome or first, best, best_genome, scored, ops, space, variants,
                lambda: self.clock() - start < cfg.time_limit_s)
        seconds = self.clock() - start
        logger.info("GA swap search: %d generations, %d evaluations (%d fit), %.3g s -> %.3g s simulated in %.1f s (%s)",
                    generations, tally.evaluations, tally.feasible, seed.step_time_s, best.step_time_s, seconds,
                    tally.stopped)
        variant = None if best_genome is None else variants(best_genome.recomputed)
        return GAResult(best, best_genome, seed.step_time_s, generations, tally.evaluations, tally.feasible, seconds,
                        tally.stopped, tuple(history), variant, polished)

    @staticmethod
    def _evaluate(children: Sequence[Genome], scored: dict[Genome, float], evaluator: Evaluator,
                  tally: "_Tally") -> dict[Genome, SwapCandidate]:
        """The children not timed yet timed into ``scored``, ``evaluator.batch`` at a time while
        the time limit and the evaluation cap allow (``tally`` counts them and says why it
        stopped); returns the plans decoded in this process, by genome."""
        pending = [c for c in dict.fromkeys(children) if c not in scored]
        decoded: dict[Genome, SwapCandidate] = {}
        while pending:
            if (reason := tally.out_of_time()) is not None:
                tally.stopped = reason
                break
            batch, pending = pending[: tally.allowed(evaluator.batch)], pending[evaluator.batch:]
            for child, result in zip(batch, evaluator.evaluate(batch)):
                scored[child] = result.seconds
                if result.candidate is not None:
                    decoded[child] = result.candidate
                logger.debug("GA evaluation %d: %.4g s", tally.evaluations, result.seconds)
                tally.evaluations += 1
                tally.feasible += math.isfinite(result.seconds)
        return decoded

    def _lead_polish(self, genome, best, best_genome, scored, ops: _Operators, space, variants, has_time):
        """After the search: batch-independent nodes pulled into the run that starts the best
        schedule (:meth:`_Operators.lead_more`), doubling that run each time (1, 2, 4, ... more
        nodes) while the plan gets faster, at most :data:`LEAD_POLISH` evaluations (not counted
        against ``max_evaluations``; within the time limit). Returns (best, its genome,
        evaluations made)."""
        made, count = 0, 1
        for _ in range(LEAD_POLISH):
            child, count = ops.lead_more(genome, count), 2 * count
            if child == genome or child in scored or not has_time():
                break
            candidate = self._decode(child, space, variants)
            scored[child] = step_time_of(candidate)
            made += 1
            if candidate is None or candidate.step_time_s >= best.step_time_s:
                break
            genome, best, best_genome = child, candidate, child
        return best, best_genome, made

    def _decode(self, genome: Genome, space: SearchSpace, variants: _Variants) -> SwapCandidate | None:
        """:func:`decode` on the genome's rewrite; None where the rewrite fails (a recompute
        choice the recompute pass refuses)."""
        try:
            variant = variants(genome.recomputed)
        except ValueError as e:
            logger.debug("GA: no rewrite for %d recomputed tensors (%s)", len(genome.recomputed), e)
            return None
        return decode(genome, space, self.planner, variant)

    def _children(self, population, scored, ops: _Operators, *, fill: bool, extra=()) -> list[Genome]:
        """Mutants of the seed while the population fills, then crossovers of tournament
        winners, each mutated. ``extra``: genomes the first generation tries as they are."""
        rng, cfg = ops.rng, self.config
        if fill:
            children = [ops.mutate(population[0]) for _ in range(cfg.population - len(population))]
            if len(population) == 1:  # the first generation: the other victim order, the batch-independent
                # nodes moved, cheap recomputes
                seeds = [ops.other_eviction(population[0])]
                seeds += [ops.independent_spread(population[0], span) for span in ("forward", "first", "step")]
                if ops.recomputable:
                    seeds[2:2] = [ops.recompute_cheaper(population[0], ratio) for ratio in RECOMPUTE_RATIOS]
                seeds = list(dict.fromkeys([*extra, *seeds]))  # all of them: the other schedules' plans
                children = seeds + children[len(seeds):]  # must not crowd out the recompute seeds
            return children
        children = []
        for _ in range(cfg.children):
            a, b = self._tournament(population, scored, rng), self._tournament(population, scored, rng)
            child = ops.crossover(a, b) if a != b and rng.random() < 0.5 else a
            children.append(ops.mutate(child))
        return children

    @staticmethod
    def _tournament(population, scored, rng: random.Random) -> Genome:
        a, b = rng.choice(population), rng.choice(population)
        return a if scored[a] <= scored[b] else b

    def _select(self, genomes, scored) -> list[Genome]:
        """The best ``population`` genomes (infeasible ones last), in a deterministic order."""
        ranked = sorted(genomes, key=lambda g: (scored[g], _order_key(g)))
        return ranked[: self.config.population]


@dataclasses.dataclass
class _Tally:
    """One search's evaluations so far, and whether its time limit or evaluation cap is reached.
    The limit is kept, not just checked: the search stops where the longest stretch between
    two checks so far (a batch of evaluations, or a generation's bookkeeping and a new best
    decoded) would run past it, with as much again left for the caller's replay of the best
    plan over two steps (about one evaluation's work)."""

    config: GAConfig
    clock: Callable[[], float]
    start: float
    evaluations: int = 0
    feasible: int = 0  # evaluations within the budget
    stopped: str = "converged"  # or "time" / "evaluations" once one of them stops the search
    last_check: float | None = None
    longest_gap: float = 0.0  # seconds between two checks, at most

    def out_of_time(self) -> str | None:
        cap = self.config.max_evaluations
        if cap is not None and self.evaluations >= cap:
            return "evaluations"
        now = self.clock()
        if self.last_check is not None:
            self.longest_gap = max(self.longest_gap, now - self.last_check)
        self.last_check = now
        return "time" if now - self.start + 2 * self.longest_gap >= self.config.time_limit_s else None

    def allowed(self, count: int) -> int:
        """At most ``count`` evaluations more, within the cap."""
        cap = self.config.max_evaluations
        return count if cap is None else min(count, cap - self.evaluations)


def _order_key(g: Genome):
    """A total order on genomes (ties in time must not depend on set iteration order)."""
    return (len(g.cuts), tuple(sorted(g.cuts)), tuple(sorted(g.host_state)), g.choices, g.eviction, g.schedule)


__all__ = ["DEFAULT_PLAN_TIME_S", "GAConfig", "GAResult", "Genome", "GeneticSwapSearch", "KEEP", "RECOMPUTE",
           "RECOMPUTE_RATIOS", "SWAP", "SearchSpace", "Variant", "decode", "seed_genome"]
