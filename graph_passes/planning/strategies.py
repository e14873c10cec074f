"""The registry of planning passes and strategies.

:data:`PASSES` names the passes a caller may allow (``recompute``, ``swap``, ``split``). A
:class:`Strategy` turns a signature that does not fit its budget into a plan with the passes
it needs; :func:`strategy_for` picks, among the registered strategies whose passes are all
allowed, the one that needs the most of them (so recompute and swap together are planned by
the strategy that weighs both, not by either alone). Split is not a strategy here: the driver
tries it last, where no strategy fits (:mod:`graph_passes.planning.split`).

A strategy sees the planner through :class:`Planner` (lowerings, the recompute planner and the
swap search) and returns a :class:`Proposal`; a new technique registers its own with
:func:`register` and needs no change to the driver.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Mapping, Protocol

import onnx

from graph_passes.cost.cost_model import AnalyticalCostModel
from graph_passes.ir.program import Program
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.blocks import BlockLayouts, PlanningTarget
from graph_passes.planning.choice import ProgramChoice, RewriteOutcome
from graph_passes.planning.offload_choice import RATIOS, recompute_first, segment_costs
from graph_passes.planning.recompute.graph_pass import recomputed_infos
from graph_passes.planning.recompute.signatures import RecomputePlanning

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pass:
    """A pass a caller may allow: its name, how messages name its use, and whether it needs a
    loss (recompute rewrites the forward that feeds one)."""

    name: str
    used_as: str
    needs_loss: bool = False


PASSES: Mapping[str, Pass] = {p.name: p for p in (
    Pass("recompute", "recompute", needs_loss=True),
    Pass("swap", "swapping"),
    Pass("split", "splitting"),
)}


@dataclasses.dataclass(frozen=True)
class SwapsFound:
    """The fastest swap plan over some lowerings (None where none fits), the least budget any of
    them needs, and the plan's simulated step time."""

    choice: ProgramChoice | None
    needed_bytes: int
    seconds: float | None = None
    variant: object = None  # graph_passes.planning.swap.ga.Variant: the graph the GA's recomputes rewrote
    others: tuple[ProgramChoice, ...] = ()  # unrefined: the other schedules' best plans of the same graph


class Planner(Protocol):
    """What a strategy plans with (:class:`graph_passes.planning.driver.StepPlanner`)."""

    target: PlanningTarget
    layouts: BlockLayouts
    recompute: RecomputePlanning

    def plan_swaps(self, programs: list[Program], infos: Mapping[str, TensorInfo], budget: int,
                   model: onnx.ModelProto, *, refine: bool = True) -> SwapsFound: ...

    def refine(self, outcome: RewriteOutcome, seconds: float, budget: int, *, search: bool = True,
               others: tuple[ProgramChoice, ...] = ()) -> RewriteOutcome: ...


@dataclasses.dataclass(frozen=True)
class Request:
    """One signature that did not fit without passes: its ``infos``, the ``budget``, the least
    budget seen so far, the unrewritten lowerings tried, and (program, trace) of the graph with
    nothing recomputed in the largest blocks where the planner has it."""

    infos: Mapping[str, TensorInfo]
    budget: int
    needed_bytes: int
    programs: list[Program]
    unrecomputed: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A strategy's answer: the outcome (its ``choice`` None where nothing fits, its
    ``needed_bytes`` the least budget seen), the candidates it weighed as (what, simulated s),
    and the recompute-or-copy cost of each segment (both None where it weighed nothing)."""

    outcome: RewriteOutcome
    candidates: tuple[tuple[str, float], ...] | None = None
    segment_costs: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    needs: frozenset[str]
    propose: Callable[[Planner, Request], Proposal]


_STRATEGIES: list[Strategy] = []


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry (a name registered again replaces the earlier one)."""
    unknown = sorted(strategy.needs - PASSES.keys())
    if unknown:
        raise ValueError(f"strategy {strategy.name!r} needs unknown passes {unknown}")
    _STRATEGIES[:] = [s for s in _STRATEGIES if s.name != strategy.name] + [strategy]
    return strategy


def strategies() -> tuple[Strategy, ...]:
    return tuple(_STRATEGIES)


def usable_passes(passes: Iterable[str], *, has_loss: bool) -> frozenset[str]:
    """The allowed passes that apply to a graph (recompute only where it has a loss)."""
    return frozenset(p for p in passes if p in PASSES and (has_loss or not PASSES[p].needs_loss))


def strategy_for(passes: Iterable[str], *, has_loss: bool) -> Strategy | None:
    """The registered strategy that needs the most of the usable ``passes`` (the first
    registered among equals), or None where none applies."""
    usable = usable_passes(passes, has_loss=has_loss)
    fitting = [s for s in _STRATEGIES if s.needs <= usable]
    return max(fitting, key=lambda s: len(s.needs), default=None)


def _recompute(planner: Planner, request: Request) -> Proposal:
    """Recompute forward segments until the graph fits (Mimose's and the checkpointing
    planners' technique: :mod:`graph_passes.planning.recompute`)."""
    outcome = planner.recompute.plan(request.infos, request.budget, request.programs, request.needed_bytes,
                                     unrecomputed=request.unrecomputed)
    return Proposal(outcome)


def _swap(planner: Planner, request: Request) -> Proposal:
    """The fastest swap plan over the graph's lowerings (:mod:`graph_passes.planning.swap`)."""
    model, infos, added = planner.target.model, request.infos, 0
    found = planner.plan_swaps(request.programs, request.infos, request.budget, model)
    if found.variant is not None:  # not without recompute allowed, which picks another strategy
        model, infos, added = found.variant.model, found.variant.infos, found.variant.added_nodes
    rewrites = () if found.variant is None else (found.variant.rewrite,)
    return Proposal(RewriteOutcome(model, infos, found.choice, added, found.needed_bytes, rewrites=rewrites))


def _recompute_or_swap(planner: Planner, request: Request) -> Proposal:
    """Recompute alone (or as far as it goes, then swap), swap alone, and the segments cheaper
    to recompute than to copy (:mod:`graph_passes.planning.offload_choice`) recomputed with the
    rest swapped: the fastest in simulation on the planning profile wins, and only its swap plan
    is searched further (the genetic search's time limit holds once)."""
    infos, budget = request.infos, request.budget
    layouts, target, profile = planner.layouts, planner.target, planner.target.profile()
    candidates: list[tuple[str, float, RewriteOutcome]] = []
    other_schedules: dict[str, tuple[ProgramChoice, ...]] = {}  # per candidate, for the GA's first generation
    least = request.needed_bytes

    def with_swaps(label: str, outcome: RewriteOutcome, programs) -> None:
        nonlocal least
        found = planner.plan_swaps(list(programs), outcome.infos, budget, outcome.model, refine=False)
        least = min(least, found.needed_bytes)
        if found.choice is not None:
            passes = ("recompute", "swap") if outcome.added_nodes else ("swap",)
            candidates.append((label, found.seconds, dataclasses.replace(outcome, choice=found.choice.with_passes(passes))))
            other_schedules[label] = found.others

    recomputed = planner.recompute.plan(infos, budget, [], request.needed_bytes)
    least = min(least, recomputed.needed_bytes)
    if recomputed.choice is not None:
        seconds = layouts.simulated_time(recomputed.choice.program, recomputed.infos, recomputed.model, budget)
        candidates.append(("recompute", seconds, recomputed))
    else:
        with_swaps("recompute all, swap the rest", recomputed, recomputed.programs)
    model = target.model
    with_swaps("swap", RewriteOutcome(model, infos, None, 0, least), layouts.lowerings(model, infos, target.schedule))
    segments = planner.recompute.segments(infos)
    costs = segment_costs(segments, model, infos, cost_model=AnalyticalCostModel(profile), profile=profile)
    saving = len([s for s in segments if s.saved_bytes > 0])
    for cheap in dict.fromkeys(recompute_first(costs, ratio) for ratio in RATIOS):
        if cheap and len(cheap) < saving:
            m_model, m_schedule, m_clones = planner.recompute.rewrite(cheap, segments)
            m_infos = recomputed_infos(infos, m_model)
            with_swaps(f"recompute {len(cheap)} cheaper segments, swap the rest",
                       RewriteOutcome(m_model, m_infos, None, m_clones, least,
                                      rewrites=(planner.recompute.recompute_pass(cheap, segments),)),
                       layouts.lowerings(m_model, m_infos, m_schedule))
    weighed = tuple((label, seconds) for label, seconds, _ in candidates)
    if not candidates:
        return Proposal(RewriteOutcome(model, infos, None, 0, least), weighed, tuple(costs))
    label, seconds, best = min(candidates, key=lambda c: c[1])
    if label != "recompute":
        planner.recompute.forget(infos)  # the recompute plan was not taken: no reuse of it
    best = planner.refine(best, seconds, budget, search=label != "recompute",  # only the winner
                          others=other_schedules.get(label, ()))
    logger.info("recompute or swap for %s on %s: %s (%s)", target.graph.name, profile.name, label,
                ", ".join(f"{name}: {t * 1e3:.2f} ms" for name, t in weighed))
    return Proposal(dataclasses.replace(best, needed_bytes=least), weighed, tuple(costs))


register(Strategy("recompute", frozenset({"recompute"}), _recompute))
register(Strategy("swap", frozenset({"swap"}), _swap))
register(Strategy("recompute or swap", frozenset({"recompute", "swap"}), _recompute_or_swap))
