"""The step planner: for one graph and one input signature, the program that fits the budget.

:class:`StepPlanner` tries, in order: the graph in its largest blocks; the state updates in a
block of their own; a recompute plan cached for a similar size; smaller blocks; then the
registered strategy for the passes the caller allows (:mod:`~graph_passes.planning.strategies`:
recompute, swap, or both with the faster in simulation winning), and split
(:mod:`~graph_passes.planning.split`) where that cannot fit. It returns a :class:`StepPlan`, or
:class:`~graph_passes.planning.choice.Infeasible` with the least budget a plan exists for, found by
planning (:mod:`~graph_passes.planning.minimum`).
Plans are timed on the target's device profile; nothing here runs the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Mapping

import onnx
import onnx_ir.passes

from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.formatting import format_bytes
from graph_passes.ir import shapes
from graph_passes.ir.allocator import OutOfArenaMemory, align_up
from graph_passes.ir.memory import MemoryTrace, simulate_program
from graph_passes.ir.program import Program, order_dependent_last, program_order
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.blocks import BlockLayouts, PlanningTarget
from graph_passes.planning.choice import Infeasible, ProgramChoice, RewriteOutcome
from graph_passes.planning.greedy_schedule import memory_greedy
from graph_passes.planning.minimum import least_budget
from graph_passes.planning.partition import refine_blocks
from graph_passes.planning.recompute.signatures import RecomputePlanning
from graph_passes.planning.schedule import state_derived_late, training_spine, updates_early
from graph_passes.planning.strategies import PASSES, Request, SwapsFound, strategy_for
from graph_passes.planning.split.graph_pass import Cut, SplitPass
from graph_passes.planning.split.planner import Bottleneck, JointPlanner, SplitMemo, split_node_count
from graph_passes.planning.swap.planner import EVICTION_ORDERS, blocks_over, required_bytes
from graph_passes.planning.recompute.graph_pass import RecomputePass
from graph_passes.planning.recompute.tensors import TensorRecompute, TensorRewrite
from graph_passes.planning.swap.ga import Variant
from graph_passes.planning.swap.plan_search import GRID, PlanSearch, refine_swap_plan
from graph_passes.planning.swap.search import STATE_NONE, SwapSearch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The program chosen for one signature, on the graph it runs (rewritten by recompute or
    split, or the target's own)."""

    infos: Mapping[str, TensorInfo]
    choice: ProgramChoice
    model: onnx.ModelProto
    recomputed_nodes: int = 0  # clone nodes the recompute pass added
    split_nodes: int = 0  # nodes the split pass added
    split_plan: object = None  # graph_passes.planning.split.planner.JointPlan
    rewrites: tuple[onnx_ir.passes.PassBase, ...] = ()  # the passes that turn the target's graph into ``model``


@dataclasses.dataclass
class _Unplanned:
    """What the first (largest-block) lowering of a signature showed."""

    budget: int | None
    need: int  # least budget of the graph with nothing recomputed, in the largest blocks
    apart: tuple[Program, MemoryTrace] | None = None  # state updates cut off, where tried
    unrecomputed: tuple[Program, MemoryTrace] | None = None  # what recompute plans start from


class StepPlanner:
    """Plans one target's graph, per input signature (with what recompute learns across sizes)."""

    def __init__(self, target: PlanningTarget, *, layouts: BlockLayouts | None = None,
                 exact_minimum: bool = True) -> None:
        """``layouts``: how the graph is lowered into blocks (default: :class:`BlockLayouts`);
        ``exact_minimum``: where no plan fits, search the least budget that plans (else state
        the least need of the plans tried)."""
        self.target = target
        self.exact_minimum = exact_minimum
        self.split_memo: SplitMemo | None = None  # shared by the planners of a least-budget search
        self.layouts = layouts or BlockLayouts(target)
        self.recompute = RecomputePlanning(self.layouts, policy=target.recompute_policy,
                                           selective=target.selective_recompute)
        self.infer_infos = shapes.ShapeInference(target.model)  # per new signature
        self.baseline_peak_bytes: int | None = None
        self.baseline_trace: MemoryTrace | None = None  # the unplanned program's, for plots
        self.last_choice: list[tuple[str, float]] = []  # recompute-or-swap candidates: (what, simulated s)
        self.last_segment_costs: list = []  # graph_passes.planning.offload_choice.SegmentCost of that choice
        self.last_plan_search: PlanSearch | None = None  # how the last swap plan was searched
        self.deadline: float | None = None  # perf_counter() when this plan's plan_time ends (set by plan)

    @property
    def _recompute_allowed(self) -> bool:
        return "recompute" in self.target.passes and bool(self.target.graph.loss_name)

    def plan(self, input_infos: Mapping[str, TensorInfo], *, probe_feeds=None,
             resolve_budget: Callable[[int], int | None]) -> StepPlan | Infeasible:
        """The plan for these input shapes. ``resolve_budget`` turns the unplanned peak into
        the budget in bytes (None: unlimited); ``probe_feeds`` are input values for shape
        probes, or a function returning them."""
        self.deadline = time.perf_counter() + self.target.plan_time  # the grid's time counts too
        if callable(probe_feeds):
            probe_feeds = probe_feeds()
        infos = self.infer_infos(input_infos, probe_feeds=probe_feeds)
        found = self._plan_at(input_infos, probe_feeds, infos, resolve_budget)
        if isinstance(found, Infeasible) and self.exact_minimum:
            found = self._least_budget(input_infos, probe_feeds, infos, found)
        return found

    def _plan_at(self, input_infos, probe_feeds, infos, resolve_budget) -> StepPlan | Infeasible:
        """:meth:`plan` for inferred ``infos``; an Infeasible states the least need seen."""
        programs: list[Program] = []
        found, needed, unplanned = self._without_passes(infos, programs, resolve_budget)
        budget = unplanned.budget
        if found is None:
            found, needed = self._with_passes(infos, programs, budget, needed, unplanned)
        bottleneck = ""
        if found is None and "split" in self.target.passes and budget is not None and self.target.swap_points is None:
            split = self._plan_split(input_infos, probe_feeds, infos, budget)
            if isinstance(split, Bottleneck):
                # The walk stops at the first op no split fits, so it cannot say what a split
                # plan would need: the least budget is searched (_least_budget).
                where = f"{split.op_type} {split.node!r}" if split.node else "a load or fetch"
                bottleneck = f" (splitting stops at {where}: {split.reason})"
            else:
                found = split
        if found is None:
            return Infeasible(needed, budget, self.target.passes, bottleneck, unplanned.need)
        if self._recompute_allowed and budget is not None:
            self.recompute.observe(infos, unplanned.need)
        return found

    def _least_budget(self, input_infos, probe_feeds, infos, infeasible: Infeasible) -> StepPlan | Infeasible:
        """The least budget this target's planner accepts for these shapes, searched
        (:func:`graph_passes.planning.minimum.least_budget`) from a 1-byte budget up, so the
        answer does not depend on the budget refused: ``infeasible`` stating it, or, where it
        is at most that budget (plans are not monotone in the budget), the plan made for it,
        which fits. Each budget is planned by a fresh planner, as a new run with that budget
        plans it, and its plan is replayed under the budget."""
        memo, plans = SplitMemo(), {}
        # What one probe's recompute planning worked out (segments, rewritten graphs) the next reuses.
        last = [RecomputePlanning(self.layouts, policy=self.target.recompute_policy,
                                  selective=self.target.selective_recompute)]

        def plan_at(budget: int) -> StepPlan | Infeasible:
            probe = StepPlanner(self.target, layouts=self.layouts, exact_minimum=False)
            probe.split_memo, probe.recompute = memo, last[0].sibling()
            probe.deadline = self.deadline  # the probes' searches share this plan's time
            last[0] = probe.recompute
            return probe._plan_at(input_infos, probe_feeds, infos, lambda _peak: budget)

        def accepts(budget: int) -> int | None:
            plan = plan_at(budget)
            need = None if isinstance(plan, Infeasible) else replayed_need(plan, budget, self.target.alignment)
            if need is not None:
                plans[budget] = plan
            return need

        start = time.perf_counter()
        with self.layouts.memoized():  # lowerings and replays are the same at every budget
            floor = plan_at(1)
            if not isinstance(floor, Infeasible):  # a graph with nothing to hold fits any budget
                return floor
            least, search = least_budget(accepts, refused=1, estimate=floor.needed_bytes, alignment=self.target.alignment,
                                         ceiling=floor.unplanned_bytes or infeasible.unplanned_bytes or floor.needed_bytes)
        logger.info("least budget of %s with passes %s: %s searched in %d plans (%.2f s), estimated %s",
                    self.target.graph.name, ",".join(self.target.passes) or "none",
                    "not found" if least is None else format_bytes(least), len(search.probes),
                    time.perf_counter() - start, format_bytes(floor.needed_bytes))
        if least is None:
            return infeasible
        if least <= infeasible.budget_bytes:
            logger.info("the plan for %s fits the budget %s", format_bytes(least), format_bytes(infeasible.budget_bytes))
            return plans[least]
        return dataclasses.replace(infeasible, needed_bytes=least)

    def _without_passes(self, infos, programs: list[Program], resolve_budget):
        """The fewest blocks that fit without rewriting the graph (or a cached recompute plan):
        (StepPlan or None, least budget seen, what the largest blocks showed)."""
        target, needed, unplanned = self.target, None, None
        for program in self.layouts.lowerings(target.model, infos, target.schedule):
            programs.append(program)
            trace = self.layouts.trace(program, infos)
            if unplanned is None:  # the largest blocks: the unplanned program
                unplanned = self._first_lowering(infos, program, trace, resolve_budget)
                needed = unplanned.need
                reused = self._reuse(infos, unplanned)
                if reused is not None:
                    return reused, needed, unplanned
            needed = min(needed, trace.min_budget_bytes)
            if unplanned.budget is None or trace.min_budget_bytes <= unplanned.budget:
                return self._fewest(infos, programs, ProgramChoice(program, trace), unplanned.budget), needed, unplanned
            if len(programs) == 1 and unplanned.apart is not None:
                needed = min(needed, unplanned.apart[1].min_budget_bytes)
                if unplanned.apart[1].min_budget_bytes <= unplanned.budget:
                    return StepPlan(infos, ProgramChoice(*unplanned.apart), target.model), needed, unplanned
            if self._recompute_allowed:
                # Recompute in large blocks before smaller blocks without it: on the CPU every
                # cut costs more than the recomputation (docs/decisions.md).
                break
        return None, needed, unplanned

    def _first_lowering(self, infos, program: Program, trace: MemoryTrace, resolve_budget) -> _Unplanned:
        """The budget, resolved against the unplanned peak, and the state updates cut off where
        that is the cheapest way to fit."""
        self.baseline_peak_bytes, self.baseline_trace = trace.peak_device_bytes, trace
        unplanned = _Unplanned(resolve_budget(trace.peak_device_bytes), trace.min_budget_bytes)
        has_cut = self.layouts.updates_cut(self.target.model, self.target.schedule) is not None
        unplanned.unrecomputed = None if has_cut else (program, trace)
        if unplanned.budget is not None and unplanned.need > unplanned.budget and has_cut:
            # The state updates in a block of their own: it frees at most the new state's bytes.
            graph = self.target.graph
            new_state = sum(infos[n].nbytes for n in graph.state_pairs.values() if n in infos)
            if unplanned.need - new_state <= unplanned.budget or (self._recompute_allowed and self.recompute.collecting):
                apart = self.layouts.lower_updates_apart(self.target.model, infos, self.target.schedule)
                unplanned.apart = unplanned.unrecomputed = (apart, self.layouts.trace(apart, infos))
                unplanned.need = min(unplanned.need, unplanned.apart[1].min_budget_bytes)
        return unplanned

    def _reuse(self, infos, unplanned: _Unplanned) -> StepPlan | None:
        """A recompute plan made for a similar input size, if this one needs it and it fits
        (Mimose's plan cache): no block-size search, no planning."""
        if not self._recompute_allowed or unplanned.budget is None:
            return None
        reused = self.recompute.reuse(infos, unplanned.budget, unplanned_fits=unplanned.need <= unplanned.budget)
        return None if reused is None else _step_plan(reused)

    def _fewest(self, infos, programs: list[Program], choice: ProgramChoice, budget: int | None) -> StepPlan:
        """``choice`` (a uniform lowering that fits), or fewer blocks cut only where memory is tight."""
        model = self.target.model
        if len(choice.program.blocks) > len(programs[0].blocks):
            program, trace = self.layouts.fewest_blocks(model, infos, self.target.schedule, budget,
                                                        choice.program, choice.trace)
            choice = ProgramChoice(program, trace)
        return StepPlan(infos, choice, model)

    def _with_passes(self, infos, programs: list[Program], budget: int, needed: int, unplanned: _Unplanned):
        """The registered strategy for the allowed passes (:mod:`graph_passes.planning.strategies`):
        (StepPlan or None, least budget seen)."""
        strategy = strategy_for(self.target.passes, has_loss=bool(self.target.graph.loss_name))
        if strategy is None:
            return None, needed
        proposal = strategy.propose(self, Request(infos, budget, needed, programs, unplanned.unrecomputed))
        if proposal.candidates is not None:
            self.last_choice, self.last_segment_costs = list(proposal.candidates), list(proposal.segment_costs or ())
        outcome = proposal.outcome
        return (None if outcome.choice is None else _step_plan(outcome)), min(needed, outcome.needed_bytes)

    def _plan_split(self, input_infos, probe_feeds, infos, budget: int) -> StepPlan | Bottleneck:
        """Split the ops too large for the budget (:class:`graph_passes.planning.split.planner.JointPlanner`),
        then plan swaps on the split graph (or, without the swap pass, the lowering that fits)."""
        target = self.target

        def lower_fine(model, model_infos):
            return self.layouts.lower_program(model, model_infos, order_dependent_last(model), max_block_nodes=1)

        def infer(model):
            return shapes.infer_tensor_infos(model, input_infos, probe_feeds=probe_feeds)

        planner = JointPlanner(lower=lower_fine, infer=infer, cost_model=AnalyticalCostModel(target.profile()),
                               alignment=target.alignment, measure=target.measure_splits, memo=self.split_memo,
                               staged_reductions=target.cpu_kernels, threads=target.intra_op_threads)
        result = planner.plan(target.model, infos, budget)
        if isinstance(result, Bottleneck):
            logger.info("split plan for %s: bottleneck %s %s needs %d bytes (%s)", target.graph.name, result.op_type,
                        result.node, result.needed_bytes, result.reason)
            return result
        model, split_infos, _ = planner.rewritten(target.model, infos, result.split)
        # The walk's rewrites (~1.4 MB each on cnn small, 196 of them) are freed here, not on
        # return, where it took ~0.5 s past the plan time; a shared memo keeps them.
        del planner
        split_nodes = split_node_count(model)
        programs = list(self.layouts.lowerings(model, split_infos, order_dependent_last(model)))
        choice, recomputed = None, 0
        split_rewrites = (SplitPass(result.split, infos, cut=Cut.SPLIT),)
        if "swap" in target.passes:
            found = self.plan_swaps(programs, split_infos, budget, model)
            choice = found.choice
            if found.variant is not None:  # the GA recomputed tensors of the split graph
                model, split_infos, recomputed = found.variant.model, found.variant.infos, found.variant.added_nodes
                split_rewrites += (found.variant.rewrite,)
        else:
            traced = ((program, self.layouts.trace(program, split_infos)) for program in programs)
            choice = next((ProgramChoice(p, t) for p, t in traced if t.min_budget_bytes <= budget), None)
        if choice is None:
            return Bottleneck("", "", budget + 1, "the split graph has no program within the budget"
                              + ("" if "swap" in target.passes else " without swapping"))
        logger.info("split plan for %s: %d ops split, %d nodes added", target.graph.name, len(result.choices),
                    split_nodes)
        return StepPlan(split_infos, choice.with_passes(("split", *choice.passes)), model, recomputed_nodes=recomputed,
                        split_nodes=split_nodes, split_plan=result, rewrites=split_rewrites)

    def refine(self, outcome: RewriteOutcome, seconds: float, budget: int, *, search: bool = True,
               others=()) -> RewriteOutcome:
        """A strategy's chosen candidate (simulated at ``seconds``): its swap plan searched further
        (:func:`refine_swap_plan`) where copies overlap compute and ``search`` is set. Strategies
        plan their candidates unrefined and refine only the winner, so the time limit holds once.
        ``others``: the same graph's other schedules' best plans (:attr:`SwapsFound.others`), in
        the search's first generation."""
        self.last_plan_search = PlanSearch(GRID, seconds, seconds, 0.0)
        if not search or not self.target.profile().copies_overlap_compute or self.target.blocks_fixed:
            return outcome
        refined = refine_swap_plan(self.layouts, outcome.choice, seconds, outcome.infos, budget, outcome.model,
                                   others=tuple(others), time_left_s=self._time_left(),
                                   **self._recompute_genes(outcome.model, outcome.infos, budget))
        self.last_plan_search = refined.search
        if refined.variant is None:
            return dataclasses.replace(outcome, choice=refined.choice)
        variant = refined.variant
        return dataclasses.replace(outcome, model=variant.model, infos=variant.infos,
                                   choice=refined.choice.with_passes(_with_recompute(refined.choice.passes)),
                                   added_nodes=outcome.added_nodes + variant.added_nodes,
                                   rewrites=(*outcome.rewrites, variant.rewrite))

    def _time_left(self) -> float | None:
        """Seconds of ``plan_time`` left for the genetic search: what planning so far (shape
        inference, split and recompute candidates, the grid) has not used; None outside
        :meth:`plan` (the GA then gets all of ``plan_time``)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    def _recompute_genes(self, model: onnx.ModelProto, infos, budget: int) -> dict:
        """The GA's per-tensor recompute genes on ``model`` (:mod:`graph_passes.planning.recompute.tensors`)
        as :func:`refine_swap_plan` takes them; none where recompute is not allowed."""
        if not self._recompute_allowed:
            return {}
        try:
            tensors = TensorRecompute(model, infos, loss_name=self.target.graph.loss_name)
        except ValueError:  # no node makes the loss in this graph
            return {}
        if not tensors.candidates:
            return {}
        profile, layouts = self.target.profile(), self.layouts

        def variant(chosen: frozenset[str]) -> Variant:
            rewrite = tensors.rewrite(chosen)
            sizes = {n: align_up(i.nbytes, self.target.alignment) for n, i in rewrite.infos.items()}
            lower_rewrite = functools.partial(layouts.lower_with_cuts, rewrite.model, rewrite.infos)
            return Variant(rewrite.model, rewrite.infos, rewrite.clones,
                           rewrite=RecomputePass(rewrite.plan, loss_name=self.target.graph.loss_name),
                           lower=lambda schedule, cuts: lower_recomputed(lower_rewrite, rewrite, sizes, budget,
                                                                         schedule, cuts),
                           evaluate=lambda p: layouts.simulated_time(p, rewrite.infos, rewrite.model, budget))

        return dict(recompute=variant, recompute_ratio=tensors.price(AnalyticalCostModel(profile), profile))

    def plan_swaps(self, programs, infos, budget: int, model: onnx.ModelProto, *, refine: bool = True) -> SwapsFound:
        """The fastest swap plan within ``budget`` over the lowered ``programs`` (simulated on
        the planning profile), the least budget any of them needs, and the plan's simulated step
        time (``refine``: then searched further, :func:`refine_swap_plan`, where copies overlap
        compute). Where copies overlap compute, the same graph is also planned in other
        schedules (:meth:`_other_schedules`), and the fastest schedule wins."""
        best, needed = self._plan_swaps_for(programs, infos, budget, model, order_dependent_last(model))
        fits = [best] if best is not None else []  # each schedule's fastest plan
        if self.target.profile().copies_overlap_compute and self.target.swap_points is None and self.target.updates_early:
            for label, schedule in self._other_schedules(programs, infos, model):
                other, needed = self._plan_other_schedule(label, schedule, infos, budget, model, needed)
                fits += [other] if other is not None else []
        if not fits:
            return SwapsFound(None, needed)
        best, *others = sorted(fits, key=lambda found: found[1])  # stable: the exported order wins ties
        if others:
            logger.info("swap plan for %s: %.3g s simulated, the other schedules' best %s", self.target.graph.name,
                        best[1], ", ".join(f"{seconds:.3g} s" for _, seconds in others))
        if refine and self.target.profile().copies_overlap_compute and not self.target.blocks_fixed:
            # Schedule, cuts, host state and keep/swap(/recompute) per tensor, searched from the grid's
            # best; the other schedules' best plans are in the first generation too.
            refined = refine_swap_plan(self.layouts, *best, infos, budget, model,
                                       others=tuple(choice for choice, _ in others), time_left_s=self._time_left(),
                                       **self._recompute_genes(model, infos, budget))
            self.last_plan_search = refined.search
            if refined.variant is None:
                return SwapsFound(refined.choice, needed, refined.seconds)
            choice = refined.choice.with_passes(_with_recompute(refined.choice.passes))
            return SwapsFound(choice, needed, refined.seconds, refined.variant)
        self.last_plan_search = PlanSearch(GRID, best[1], best[1], 0.0)
        return SwapsFound(best[0], needed, best[1], others=tuple(choice for choice, _ in others))

    def _other_schedules(self, programs, infos, model: onnx.ModelProto):
        """(label, schedule) of the orders planned beside the given one: state updates as soon as
        their gradients exist (:func:`graph_passes.planning.schedule.updates_early`), and the
        memory-greedy order (:func:`graph_passes.planning.greedy_schedule.memory_greedy`) with
        its state updates early too (the greedy rule alone leaves an update, which makes new
        state and frees little, for later), and that order with the nodes computed from the
        state alone right before their readers
        (:func:`graph_passes.planning.schedule.state_derived_late`). All three move state updates
        into the backward, so none where the target keeps them after it."""
        graph = self.target.graph
        base = program_order(model, programs[0], self.layouts.node_io_of(model))
        spine = training_spine(graph.roles, graph.state_pairs, [o.name for o in model.graph.output])
        early = updates_early(model, spine, base) if spine is not None else None
        if early is not None:
            yield "state updates early", early
        greedy = memory_greedy(model, infos, base)
        if greedy is not None:
            greedy_early = updates_early(model, spine, greedy) if spine is not None else None
            yield "memory-greedy order", greedy_early or greedy
            late = state_derived_late(model, graph.state_inputs, greedy_early or greedy)
            if late is not None:
                yield "memory-greedy order, state-derived nodes late", late

    def _plan_other_schedule(self, label: str, schedule, infos, budget: int, model: onnx.ModelProto,
                             needed: int):
        """The plan of the same graph in ``schedule`` ((choice, seconds) or None), and the least
        budget of it and ``needed``."""
        name = self.target.graph.name
        try:
            programs = list(self.layouts.lowerings(model, infos, schedule))
        except ValueError as e:  # not a topological order (seen on split graphs): a speed-up only
            logger.info("swap plan for %s: no %s (%s); the given order stays", name, label, e)
            return None, needed
        other, other_needed = self._plan_swaps_for(programs, infos, budget, model, schedule)
        if other is not None:
            logger.info("swap plan for %s: %s, %.3g s simulated", name, label, other[1])
        return other, min(needed, other_needed)

    def _plan_swaps_for(self, programs, infos, budget: int, model: onnx.ModelProto, schedule):
        """:meth:`plan_swaps` for one schedule (``programs``: lowerings of it): ((choice,
        seconds) or None, least budget)."""
        target = self.target
        sizes = {n: align_up(i.nbytes, target.alignment) for n, i in infos.items()}
        needed = min(required_bytes(program, sizes) for program in programs)
        if needed <= budget and not target.blocks_fixed:
            # Besides N-node blocks everywhere: blocks cut only where one alone would not fit.
            order = list(schedule) if schedule is not None else list(range(len(model.graph.node)))
            refined = refine_blocks(lambda cuts: self.layouts.lower_with_cuts(model, infos, schedule, cuts),
                                    lambda p: (blocks_over(p, sizes, budget), None),
                                    position_of={node: k for k, node in enumerate(order)})
            if refined is not None and all(len(refined[0].blocks) < len(p.blocks) for p in programs
                                           if required_bytes(p, sizes) <= budget):
                programs = [refined[0], *programs]
        profile = target.profile()
        if profile.copies_overlap_compute:
            # Smaller blocks let copies start sooner: go on down the block sizes while they
            # keep getting faster. Clean-first victims free room without waiting for a copy out.
            search = SwapSearch(while_improving=True, eviction_orders=EVICTION_ORDERS)
        else:
            # Copies cost the compute's own cores whenever they run (the CPU device): Belady's
            # own plan, with evictions where memory needs them; only the block size is searched.
            search = SwapSearch(state_placements=(STATE_NONE,), early_swap_outs=False)
        result = search.search(programs, infos, budget=budget, alignment=target.alignment,
                               session_bytes=target.session_bytes,
                               evaluate=lambda program: self.layouts.simulated_time(program, infos, model, budget))
        if result is None:
            return None, needed
        best = result.best
        logger.info(
            "swap plan for %s on %s: %d blocks, state on host %r, %d swaps, %s out / %s in per step",
            target.graph.name, profile.name, len(best.base_program.blocks), best.state_placement, best.plan.swap_count,
            format_bytes(best.plan.swap_out_bytes), format_bytes(best.plan.swap_in_bytes),
        )
        choice = ProgramChoice(best.program, best.trace, ("swap",), best.base_program, best.plan)
        return (choice, best.step_time_s), needed


def lower_recomputed(lower_with_cuts: Callable[[list[int], list[int]], Program], rewrite: TensorRewrite,
                     sizes: Mapping[str, int], budget: int, schedule, cuts) -> Program:
    """A per-tensor recompute rewrite lowered from a schedule and cuts of the graph it rewrote:
    each clone in its reader's block, or every clone in a block of its own where a block would
    not fit ``budget`` (no swap plan could run it), as under tight budgets a run of clones
    re-creates more than fits at once."""
    program = lower_with_cuts(*rewrite.schedule(schedule, cuts))
    if not blocks_over(program, sizes, budget):
        return program
    return lower_with_cuts(*rewrite.schedule(schedule, cuts, isolate_clones=True))


def _with_recompute(passes: tuple[str, ...]) -> tuple[str, ...]:
    return passes if "recompute" in passes else ("recompute", *passes)


def _step_plan(outcome: RewriteOutcome) -> StepPlan:
    return StepPlan(outcome.infos, outcome.choice, outcome.model, recomputed_nodes=outcome.added_nodes,
                    rewrites=outcome.rewrites)


def replayed_need(plan: StepPlan, budget: int, alignment: int) -> int | None:
    """The least budget ``plan``'s program replays in, where it replays within ``budget`` with
    the arena capped at it as the runtime caps it; None where it does not."""
    try:
        trace = simulate_program(plan.choice.program, plan.infos, budget=budget, alignment=alignment)
    except OutOfArenaMemory:
        return None
    need = max(trace.min_budget_bytes, plan.choice.trace.min_budget_bytes)
    return need if need <= budget and trace.peak_device_bytes <= budget else None


def describe_infeasible(infeasible: Infeasible, graph_name: str, *, fixed_plan: bool = False) -> str:
    """The one-line message for a budget no plan fits: the least budget and what was tried.

    ``fixed_plan``: the graph carries its own plan (swap nodes from ``ort-offload transform``),
    so no passes apply and asking for some would not help. Where no least budget is known above
    the budget (the search found none), none is stated."""
    offered = [PASSES[p].used_as for p in PASSES if p in infeasible.passes]
    if fixed_plan:
        how, other = ("with the swaps written into it (a planned graph runs its own plan: no passes apply)",
                      ", or transform the original graph again for this budget")
    elif offered:
        how, other = f"with {' and '.join(offered)}", ""
    else:
        how, other = "without offload passes", " (or plan with --passes auto)"
    needed, budget = infeasible.needed_bytes, format_bytes(infeasible.budget_bytes)
    if needed <= infeasible.budget_bytes:  # a planner's least need it found no plan for: not a minimum
        return f"no plan of {graph_name} {how} fits the budget {budget}; raise the budget{other}{infeasible.bottleneck}"
    return (f"budget {budget} is below the {format_bytes(needed)} ({needed} bytes) {graph_name} needs {how}; "
            f"raise the budget to at least that{other}{infeasible.bottleneck}")
