"""Recompute planning across input signatures: what the step planner does when a new input
shape needs recomputation to fit its budget (Mimose).

One graph with a dynamic sequence (and batch) axis serves every input size. Per graph this
module keeps what does not depend on the size (the forward segments, found once; the rewritten
graph of each segment set, whose block sessions serve every size the plan is used at) and what
is learned across sizes (the per-layer memory estimator, the plan cache). For a new signature
whose unplanned graph does not fit:

1. **Plan cache**: a plan made for a similar size (same :class:`~graph_passes.planning.recompute.mimose.PlanCache`
   bucket) is checked for this size: the graph it rewrites, lowered with the same block
   boundaries, replayed through the arena. If it fits, it is used (a reuse, no planning).
2. **New plan**, first with the graph in its largest blocks (on this CPU a block cut costs more
   than recomputation), the state updates in a block of their own where they trail the
   backward (:meth:`~graph_passes.planning.blocks.BlockLayouts.lower_updates_apart`: the planner tries
   that cut alone before planning; a plan's new state then never meets its activations).
   While the estimator is fitting (the first sizes), the bucket rule starts from what this
   size's exact saved bytes and replayed need choose and continues with the excess measured by
   a memory replay after every further choice. Once fitted, the rule runs on predicted bytes
   alone (sub-millisecond: the plan time reported), each
   segment credited with the share of its saved bytes that earlier plans actually took off the
   least budget (:meth:`RecomputePlanning.credit`); then one replay checks the plan; if the
   estimate fell short, the rule continues with measured excess. Every such plan starts from
   the segments' selective units (:mod:`graph_passes.planning.recompute.selective`: their cheap saved
   values, indexed after the segments), and the rule counts each segment for what its units
   do not free; where the chosen segments fit without the units, the units are dropped.
3. Only if recomputing every segment does not fit in the largest blocks (known without a replay
   where it did not at input dimensions no larger, under a budget no smaller): the bucket rule
   with single-node blocks; that plan and every segment recomputed each get a block layout their
   rewritten graph already ran with at another size if one fits (its sessions exist), else
   their fewest blocks that fit; fewer blocks win.
4. The plan made at a larger size with the fewest cloned nodes replaces the new plan where it
   clones fewer, fits here in its own block layout and has no more blocks (the bucket rule,
   run afresh at a smaller size, can end with more segments). The plan and its block
   boundaries go into the cache.

Every new signature, planned or not, is a sample for the estimator until it is fitted (the
first :data:`~graph_passes.planning.recompute.mimose.FIT_SIZES` sizes: Mimose's collection phase); after that
the estimator's error is recorded per layer at each new size.

``policy="static"`` keeps one cache entry for every size: the first plan (made at the first
signature that needs one; the benchmark makes that the longest) is applied to every later size
it fits, also where the unplanned graph would fit: the Sublinear-style worst-case plan that
Mimose compares against.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.formatting import format_bytes
from graph_passes.planning.recompute.mimose import CACHE_GRANULARITY, FIT_SIZES, LayerMemoryEstimator, PlanCache, input_size, plan_from_estimates
from graph_passes.ir.program import Program, order_dependent_last
from graph_passes.planning.recompute.planner import NoRecomputePlan, RecomputePlan, RecomputePlanner, Segment, forward_segments
from graph_passes.planning.recompute.graph_pass import RecomputePass, RecomputeWriter, clone_sources, recomputed_infos
from graph_passes.planning.recompute.selective import selective_units
from graph_passes.planning.blocks import BlockLayouts
from graph_passes.planning.choice import ProgramChoice, RewriteOutcome

# How plans follow the input size: "input_aware" (Mimose: a plan per size bucket) or "static"
# (the first plan serves every size it fits).
RECOMPUTE_POLICIES = ("input_aware", "static")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """A plan in the cache: the segments recomputed and where the blocks start."""

    segments: tuple[int, ...]
    cuts: tuple[int, ...]  # schedule positions of block starts (after the first)


@dataclasses.dataclass
class RecomputeStats:
    plans: int = 0  # new plans made (cache misses)
    reuses: int = 0  # signatures served by a cached plan of a similar size
    estimated_plans: int = 0  # ... of the new plans, those made from the estimator's predictions
    estimate_fell_short: int = 0  # estimated plans the replay found over budget (continued exactly)
    plan_times_s: list[float] = dataclasses.field(default_factory=list)  # per new plan: the choosing
    estimated_plan_times_s: list[float] = dataclasses.field(default_factory=list)  # ... from the estimator

    def summary(self) -> dict:
        estimated = self.estimated_plan_times_s
        return {
            "recompute_plans": self.plans,
            "recompute_plan_reuses": self.reuses,
            "estimated_plans": self.estimated_plans,
            "estimate_fell_short": self.estimate_fell_short,
            "plan_time_s_median": statistics.median(self.plan_times_s) if self.plan_times_s else None,
            "estimated_plan_time_s_median": statistics.median(estimated) if estimated else None,
        }


class RecomputePlanning:
    """Recompute plans for one graph, across input signatures."""

    def __init__(self, layouts: BlockLayouts, *, policy: str = "input_aware", fit_sizes: int = FIT_SIZES,
                 selective: bool = True) -> None:
        if policy not in RECOMPUTE_POLICIES:  # set_offload_device checks it too; this class is usable alone
            raise ValueError(f"unknown recompute policy {policy!r}: use one of {', '.join(RECOMPUTE_POLICIES)}")
        self.layouts = layouts
        self.policy = policy
        self.cache: PlanCache[CachedPlan] = PlanCache(None if policy == "static" else CACHE_GRANULARITY)
        self.fit_sizes = fit_sizes
        self.selective = selective  # plans start from the segments' cheap units
        self.estimator: LayerMemoryEstimator | None = None
        self.stats = RecomputeStats()
        self._layout: list[tuple[tuple[int, ...], tuple[str, ...]]] | None = None  # segments' nodes, saved values
        self._unit_layout: list[tuple[tuple[int, ...], tuple[str, ...], int]] | None = None  # ... and segment
        self._rewritten: dict[tuple[int, ...], tuple] = {}  # segment indices -> (model, schedule, clones)
        self._clone_sources: dict[tuple[int, ...], dict[str, str]] = {}  # ... -> clone output -> original
        self._writer: RecomputeWriter | None = None  # writes the rewritten graphs (the target's, in onnx_ir)
        self._credits: list[float] = []  # per plan made: least-budget reduction / saved bytes recomputed
        self._layouts: dict[tuple[int, ...], set[tuple[int, ...]]] = {}  # segment set -> block layouts used
        self._made: dict[int, CachedPlan] = {}  # input size -> the plan made there
        # (data input dimensions, budget) where every segment recomputed did not fit the largest blocks
        self._largest_blocks_exceeded: list[tuple[tuple[int, ...], int]] = []

    def sibling(self) -> "RecomputePlanning":
        """A planning of the same graph with nothing planned, cached or observed, as a new run's
        is, sharing this one's size-independent parts (segments, units, rewritten graphs) so it
        finds the same without working them out again (the least-budget search plans one
        signature at many budgets, each as a new run would)."""
        other = RecomputePlanning(self.layouts, policy=self.policy, fit_sizes=self.fit_sizes, selective=self.selective)
        other._layout, other._unit_layout = self._layout, self._unit_layout
        other._rewritten, other._clone_sources, other._writer = self._rewritten, self._clone_sources, self._writer
        if other._layout is not None:
            other.estimator = LayerMemoryEstimator(len(other._layout), fit_sizes=other.fit_sizes)
        return other

    # ---- size-independent parts -------------------------------------------------------------

    def segments(self, infos) -> list[Segment]:
        """The forward segments (found at the first size), with this size's saved bytes."""
        model, loss = self.layouts.target.model, self.layouts.target.graph.loss_name
        if self._layout is None:
            self._layout = [(s.nodes, s.saved) for s in forward_segments(model, infos, loss_name=loss)]
            self.estimator = LayerMemoryEstimator(len(self._layout), fit_sizes=self.fit_sizes)
        return [Segment(k, nodes, saved, sum(infos[n].nbytes for n in saved if n in infos))
                for k, (nodes, saved) in enumerate(self._layout)]

    def units(self, infos) -> list[Segment]:
        """The segments' selective units (:mod:`graph_passes.planning.recompute.selective`; found at
        the first size, indexed after the segments), with this size's saved bytes; none
        without ``selective``."""
        segments = self.segments(infos)
        if self._unit_layout is None:
            cost_model = AnalyticalCostModel(self.layouts.target.profile())
            found = selective_units(segments, self.layouts.target.model, infos, cost_model=cost_model,
                                    first_index=len(segments)) if self.selective else []
            self._unit_layout = [(u.nodes, u.saved, u.within) for u in found]
        return [Segment(len(segments) + k, nodes, saved, sum(infos[n].nbytes for n in saved if n in infos), within)
                for k, (nodes, saved, within) in enumerate(self._unit_layout)]

    @property
    def collecting(self) -> bool:
        """Whether the estimator still collects samples (:meth:`observe` takes the need)."""
        return self.estimator is None or not self.estimator.ready

    def recomputables(self, infos) -> list[Segment]:
        """Segments and then units: what a plan's indices (and :meth:`rewrite`'s keys) index."""
        return self.segments(infos) + self.units(infos)

    def key_of(self, plan: RecomputePlan) -> tuple[int, ...]:
        """The plan's indices, without the units of segments it recomputes whole (their values
        are among the segment's clones): one key, one rewritten graph, one set of sessions."""
        whole = {s.index for s in plan.segments}
        return tuple(sorted(s.index for s in plan.segments if s.within not in whole))

    def recompute_pass(self, key: tuple[int, ...], segments: list[Segment]) -> RecomputePass:
        """The pass that writes these segments (and units) into the target's graph (``key`` as
        :meth:`key_of` gives it): what :meth:`rewrite` applies, and what a plan carries."""
        return RecomputePass(RecomputePlan(tuple(segments[k] for k in key)), loss_name=self.layouts.target.graph.loss_name)

    def rewrite(self, key: tuple[int, ...], segments: list[Segment]):
        """(model, schedule, clone count) of the graph with these segments (and units)
        recomputed (``key`` as :meth:`key_of` gives it)."""
        if key not in self._rewritten:
            if self._writer is None:
                self._writer = RecomputeWriter(self.layouts.target.model, loss_name=self.layouts.target.graph.loss_name)
            model, clones = self._writer.write(self.recompute_pass(key, segments).plan)
            self._rewritten[key] = (model, order_dependent_last(model, self.layouts.node_io_of(model)), clones)
            self._clone_sources[key] = clone_sources(model)
        return self._rewritten[key]

    def infos_for(self, key: tuple[int, ...], segments: list[Segment], infos) -> dict:
        """``infos`` with the clones of the graph :meth:`rewrite` gives for ``key``."""
        model = self.rewrite(key, segments)[0]
        return recomputed_infos(infos, model, sources=self._clone_sources[key])

    # ---- planning ---------------------------------------------------------------------------

    def reuse(self, infos, budget: int, *, unplanned_fits: bool) -> RewriteOutcome | None:
        """A cached plan of a similar size, checked at this size, if it fits ``budget``, else None. Input-aware, only where the unplanned graph
        does not fit (``unplanned_fits``); static, always (the fixed plan is the program)."""
        if self._layout is None or (unplanned_fits and self.policy != "static"):
            return None
        size = input_size(infos, self.layouts.target.graph.data_inputs)
        cached = self.cache.get(size)
        if cached is None:
            return None
        segments = self.recomputables(infos)
        model, schedule, clones = self.rewrite(cached.segments, segments)
        model_infos = self.infos_for(cached.segments, segments, infos)
        program, trace = self._lowered_with_cuts(model, schedule, model_infos, cached.cuts)
        if trace.min_budget_bytes > budget:
            logger.info("cached recompute plan (%d segments) needs %s at input size %d, over the budget: "
                        "planning anew", len(cached.segments), format_bytes(trace.min_budget_bytes), size)
            return None
        self.stats.reuses += 1
        return RewriteOutcome(model, model_infos, ProgramChoice(program, trace, ("recompute",)), clones,
                              trace.min_budget_bytes, (program,), (self.recompute_pass(cached.segments, segments),))

    def _largest_blocks_known_exceeded(self, dims: tuple[int, ...], budget: int) -> bool:
        """Whether every segment recomputed did not fit the largest blocks at data input
        dimensions no larger than ``dims`` under a budget no smaller: then it does not here
        either, and the bucket rule would only replay its way to that."""
        return any(budget <= under and all(d >= e for d, e in zip(dims, at))
                   for at, under in self._largest_blocks_exceeded)

    def _known_layout(self, key, model, schedule, model_infos, budget: int):
        """(program, trace) in the fewest-block layout this rewritten graph already ran with at
        another size, if one fits ``budget``: its block sessions exist (a new layout's sessions
        cost more to create, in its first run, than an extra block costs per step)."""
        for cuts in sorted(self._layouts.get(key, ()), key=len):
            program, trace = self._lowered_with_cuts(model, schedule, model_infos, cuts)
            if trace.min_budget_bytes <= budget:
                return program, trace
        return None

    def _lowered_with_cuts(self, model, schedule, model_infos, cuts):
        """(program, memory trace) of a rewritten graph in the block layout ``cuts``."""
        program = self.layouts.lower_with_cuts(model, model_infos, schedule, cuts)
        return program, self.layouts.trace(program, model_infos)

    def forget(self, infos) -> None:
        """Drop the cached plan of this input size's bucket (a plan the step planner did not take)."""
        self.cache.discard(input_size(infos, self.layouts.target.graph.data_inputs))

    def observe(self, infos, unplanned_need: int) -> None:
        """Feed a new input size to the estimator (the step planner calls this once per signature):
        the layers' saved bytes, exact from shapes, and the least budget of the unplanned
        graph in the largest blocks plans start from (``unplanned_need``, from the planner's
        replays: the state updates cut off where that needs less), as
        Mimose's collector does for the first sizes. Once fitted, the estimator only records
        its error here."""
        segments = self.segments(infos)
        size = input_size(infos, self.layouts.target.graph.data_inputs)
        self.estimator.observe(size, [s.saved_bytes for s in segments], None if self.estimator.ready else unplanned_need)

    def plan(self, infos, budget: int, programs: list[Program], needed: int, *, unrecomputed=None) -> RewriteOutcome:
        """Recompute forward segments until the graph fits ``budget`` (or, with swap also
        allowed, as far as recompute goes). ``programs``: the unrewritten graph's lowerings
        tried so far; ``needed``: the least budget seen; ``unrecomputed``: (program, memory
        trace) of the graph with nothing recomputed in the largest blocks, where the caller has it.

        First in the largest blocks (what runs fastest here: every cut costs more than the
        recomputation it saves): the bucket rule picks segments until the rewritten graph fits
        in them, measured by replay, starting from the estimator's plan once it is fitted. Only
        if recomputing everything does not fit there: the same rule with single-node blocks,
        then whichever of that plan and everything recomputed fits in fewer blocks. Every plan
        starts from the segments' cheap units (selective recomputation)."""
        at = _SizePlanning(self, infos, budget, unrecomputed)
        self.stats.plans += 1
        result = self._plan_in_largest_blocks(at, needed)
        if isinstance(result, RecomputePlan):
            key = self.key_of(result)
            program, trace = at.lowered(key, False)
        else:  # not in the largest blocks: the least recompute that fits in single-node blocks
            found = self._plan_in_fewest_blocks(at, programs, needed)
            if isinstance(found, RewriteOutcome):
                return found
            key, program, trace = found
        return self._settle(at, key, program, trace)

    def _plan_in_largest_blocks(self, at: "_SizePlanning", needed: int):
        """The bucket rule in the largest blocks, from the estimator's plan (or this size's exact
        bytes while it collects); None where this is known not to fit, NoRecomputePlan where it
        does not."""
        start_time = time.perf_counter()
        if self.estimator.ready:
            layer_bytes, need_bytes = self.estimator.predict_layers(at.size), self.estimator.predict_need(at.size)
        else:
            # While the estimator collects its sizes: this size's own bytes, exact from shapes,
            # and the unplanned need just replayed, so the rule starts near the plan.
            layer_bytes, need_bytes = [s.saved_bytes for s in at.layers], needed
        credit = self.credit()
        first = plan_from_estimates([credit * (b - u) for b, u in zip(layer_bytes, at.unit_bytes)],
                                    need_bytes - at.budget - credit * sum(at.unit_bytes))
        if self.estimator.ready:
            self.stats.plan_times_s.append(time.perf_counter() - start_time)
            self.stats.estimated_plan_times_s.append(self.stats.plan_times_s[-1])
            self.stats.estimated_plans += 1
        dims = tuple(d for name in self.layouts.target.graph.data_inputs for d in at.infos[name].shape)
        result: RecomputePlan | NoRecomputePlan | None = None  # None: the largest blocks not tried
        if not self._largest_blocks_known_exceeded(dims, at.budget):
            result = RecomputePlanner().plan(at.picking, at.budget, at.need(False),
                                             start=at.units + [at.picking[k] for k in first])
        if isinstance(result, NoRecomputePlan):
            self._largest_blocks_exceeded.append((dims, at.budget))
        if not self.estimator.ready:
            self.stats.plan_times_s.append(time.perf_counter() - start_time)
        elif isinstance(result, RecomputePlan) and len(result.segments) > len(at.units) + len(first):
            self.stats.estimate_fell_short += 1
        if isinstance(result, RecomputePlan) and result.saved_bytes > 0:
            # How much of the recomputed segments' saved bytes came off the least budget.
            self._credits.append((at.need(False)(RecomputePlan(())) - at.need(False)(result)) / result.saved_bytes)
        if isinstance(result, RecomputePlan) and any(s.within is not None for s in result.segments):
            # Units go first, segments after; where the segments alone fit, the units saved no
            # segment and would only cost time.
            whole = RecomputePlan(tuple(s for s in result.segments if s.within is None))
            if at.need(False)(whole) <= at.budget:
                result = whole
        return result

    def _plan_in_fewest_blocks(self, at: "_SizePlanning", programs: list[Program], needed: int):
        """The least recompute that fits in single-node blocks and every segment recomputed,
        each in a block layout it already ran with or its fewest blocks that fit: (key,
        program, trace) of the one with fewer blocks (ties: less recomputed); a RewriteOutcome
        without a choice where nothing fits (with swap allowed: as far as recompute goes)."""
        target = self.layouts.target
        result = RecomputePlanner().plan(at.layers, at.budget, at.need(True))  # segments only
        if isinstance(result, NoRecomputePlan):
            if "swap" not in target.passes:
                return RewriteOutcome(target.model, at.infos, None, 0, min(needed, result.needed_bytes), tuple(programs))
            result = RecomputePlan(tuple(at.layers))  # as far as recompute goes; swap does the rest
        best = None  # (blocks, clones, key, program, trace)
        candidates: list[Program] = []  # the plan's uniform lowerings, for swap to start from
        for plan in dict.fromkeys([RecomputePlan(tuple(at.layers)), result]):
            key = self.key_of(plan)
            model, schedule, clones = self.rewrite(key, at.segments)
            fitting = self._known_layout(key, model, schedule, at.model_infos(key), at.budget)
            if fitting is None:
                fitting = self.layouts.fewest_fitting_blocks(model, at.model_infos(key), schedule, at.budget,
                                                             max_blocks=None if best is None else best[0],
                                                             tried=candidates if plan == result else None)
            if fitting is not None and (best is None or (len(fitting[0].blocks), clones) < best[:2]):
                best = (len(fitting[0].blocks), clones, key, *fitting)
        if best is None:  # only with swap allowed: swap does the rest
            key = self.key_of(result)
            model, _, clones = self.rewrite(key, at.segments)
            return RewriteOutcome(model, at.model_infos(key), None, clones, min(needed, at.need(True)(result)),
                                  tuple(candidates), (self.recompute_pass(key, at.segments),))
        return best[2:]

    def _settle(self, at: "_SizePlanning", key, program: Program, trace) -> RewriteOutcome:
        """The plan for this size (or a cheaper one made at a larger size), cached with its
        block layout."""
        model, schedule, clones = self.rewrite(key, at.segments)
        cuts = _block_starts(program, schedule, len(model.graph.node))
        cheaper = self._cheaper_from_larger_size(at.size, at.segments, clones, len(program.blocks), at.model_infos,
                                                 at.budget)
        if cheaper is not None:
            key, cuts, program, trace = cheaper
            model, schedule, clones = self.rewrite(key, at.segments)
        self._made[at.size] = made = CachedPlan(key, cuts)
        self.cache.put(at.size, made)
        self._layouts.setdefault(key, set()).add(cuts)
        layers = len(at.layers)
        logger.info("recompute plan for %s at input size %d: %d of %d segments (and %d units), %d nodes cloned, "
                    "%d blocks", self.layouts.target.graph.name, at.size, len([k for k in key if k < layers]), layers,
                    len([k for k in key if k >= layers]), clones, len(program.blocks))
        return RewriteOutcome(model, at.model_infos(key), ProgramChoice(program, trace, ("recompute",)), clones,
                              trace.min_budget_bytes, (program,), (self.recompute_pass(key, at.segments),))

    def _cheaper_from_larger_size(self, size: int, segments, clones: int, blocks: int, model_infos, budget: int):
        """(key, cuts, program, trace) of the plan made at a larger input size with the fewest
        cloned nodes, if that is fewer than ``clones`` and it fits ``budget`` here in its own
        block layout with at most ``blocks`` blocks; else None. A plan that fits a larger size
        nearly always fits a smaller one, but the bucket rule run afresh can choose more: it
        adds one segment at a time, and at a smaller size everything recomputed may fit in the
        largest blocks, where the larger size needed a fitted layout with one segment fewer.
        One check: the cheapest candidate."""
        candidates = {plan for made_at, plan in self._made.items() if made_at > size}
        if not candidates:
            return None
        plan = min(candidates, key=lambda p: (self.rewrite(p.segments, segments)[2], len(p.cuts), p.segments))
        model, schedule, other_clones = self.rewrite(plan.segments, segments)
        if other_clones >= clones or len(plan.cuts) + 1 > blocks:
            return None
        program, trace = self._lowered_with_cuts(model, schedule, model_infos(plan.segments), plan.cuts)
        if trace.min_budget_bytes > budget:
            return None
        logger.info("recompute plan at input size %d: the %d-segment plan of a larger size (%d nodes cloned, not %d)",
                    size, len(plan.segments), other_clones, clones)
        return plan.segments, plan.cuts, program, trace

    def credit(self) -> float:
        """The share of a segment's saved bytes a plan can count on taking off the least
        budget: Mimose credits all of it, but a recomputed segment's checkpoint and its clones
        still need memory. The median over measured plans (1 before any), at most 1."""
        return min(1.0, statistics.median(self._credits)) if self._credits else 1.0

    def summary(self) -> dict:
        """Plan counts and times, and the estimator's per-layer errors."""
        out = self.stats.summary()
        out["policy"] = self.policy
        out["estimator_fitted"] = bool(self.estimator and self.estimator.ready)
        out["saved_bytes_credit"] = self.credit()
        out["estimator_error_per_layer"] = self.estimator.error_summary() if self.estimator else []
        return out


class _SizePlanning:
    """One input size being planned: its segments and units, and the rewritten graphs' infos and
    lowerings (largest or single-node blocks) computed so far."""

    def __init__(self, planning: RecomputePlanning, infos, budget: int, unrecomputed) -> None:
        self.planning, self.infos, self.budget = planning, infos, budget
        self.layers = planning.segments(infos)
        self.units = planning.units(infos)
        self.segments = self.layers + self.units  # what plan keys index
        self.unit_bytes = [sum(u.saved_bytes for u in self.units if u.within == s.index) for s in self.layers]
        self.picking = [dataclasses.replace(s, saved_bytes=s.saved_bytes - self.unit_bytes[s.index])
                        for s in self.layers]
        self.size = input_size(infos, planning.layouts.target.graph.data_inputs)
        self._infos: dict[tuple[int, ...], dict] = {}
        self._traced: dict[tuple[tuple[int, ...], bool], tuple[Program, object]] = {}
        if unrecomputed is not None:  # an empty plan rewrites no node
            self._infos[()] = infos
            self._traced[((), False)] = unrecomputed

    def model_infos(self, key):
        if key not in self._infos:
            self._infos[key] = self.planning.infos_for(key, self.segments, self.infos)
        return self._infos[key]

    def lowered(self, key, finest: bool):
        """(program, memory trace) of these segments recomputed, in the largest blocks (the
        state updates cut off where they trail the backward) or in single-node blocks."""
        if (key, finest) not in self._traced:
            layouts = self.planning.layouts
            model, schedule, _ = self.planning.rewrite(key, self.segments)
            if finest:
                blocks = layouts.target.max_block_nodes or 1
                program = layouts.lower_program(model, self.model_infos(key), schedule, max_block_nodes=blocks)
            else:
                program = (layouts.lower_updates_apart(model, self.model_infos(key), schedule)
                           or next(iter(layouts.lowerings(model, self.model_infos(key), schedule))))
            self._traced[(key, finest)] = (program, layouts.trace(program, self.model_infos(key)))
        return self._traced[(key, finest)]

    def need(self, finest: bool):
        return lambda plan: self.lowered(self.planning.key_of(plan), finest)[1].min_budget_bytes


def _block_starts(program: Program, schedule, num_nodes: int) -> tuple[int, ...]:
    """Schedule positions where the program's blocks start (after the first)."""
    order = list(schedule) if schedule is not None else list(range(num_nodes))
    position_of = {node: k for k, node in enumerate(order)}
    return tuple(sorted(min(position_of[i] for i in block.node_indices)
                        for block in program.blocks[1:] if block.node_indices))


__all__ = ["CachedPlan", "RecomputePlanning", "RecomputeStats"]
