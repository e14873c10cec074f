"""Joint planner over swap and split (TSPLIT Alg. 2): which ops to split, how, and into how
many micro-ops, so that a swap plan fits the budget.

The planner walks the schedule (the graph lowered one node per block, as the swap planner's
least budget sees it) and stops at the first *bottleneck*: a step whose own inputs, outputs and
workspace exceed the budget. There, swapping or recomputing any other live tensor saves nothing
(``ΔM = 0``: the bound already assumes every other tensor is on the host), so the options are
the splits of the op: every axis its rule offers (:mod:`graph_passes.planning.split.rules`) and
``p`` in :data:`SPLIT_PARTS` (per axis, up to the fewest parts that make the op fit: more
only add launches). Each is written into the graph (:mod:`graph_passes.planning.split.graph_pass`,
one ``Split`` per input, so the lowering can make it a view) and lowered again; its ``ΔM`` is
the op's need less the most any node of the split needs (measured on the lowered program, views
and merges included, so the planner never counts a saving the runtime does not realise) and its
``ΔT`` is TSPLIT Eq. 6 (:mod:`graph_passes.planning.split.cost`). Among the options that make the op fit,
the exact ones (every output merged by Concat or chained, so the split graph computes the same
bits) come first, and among those the lowest ``ΔT/ΔM`` wins; a split that sums partial results
(rounding differently) is taken only where no exact one fits. Then the walk goes on. Where no
option fits, planning stops with the :class:`Bottleneck`. Once every step fits, everything else
is the swap planner's: Belady eviction of live tensors, which is Alg. 2's swap choice for the
tensor used furthest away.

The result is a frozen :class:`JointPlan`, checked before it is returned: the split graph,
lowered one node per block, swap-planned and replayed through the arena
(:func:`graph_passes.ir.memory.simulate_program`) under the budget.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Callable, Mapping

import onnx

from graph_passes.cost.cost_model import CostModel, ProfiledCostModel
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT, align_up
from graph_passes.ir.memory import simulate_program
from graph_passes.ir.program import Program, RunBlock
from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.split.absorb import absorb_readers
from graph_passes.planning.split.cost import measure_node_times, split_added_time
from graph_passes.planning.split.graph_pass import PASS_KEY, PASS_NAME, Cut, SplitPlan, SplitRun, write_split_plan
from graph_passes.planning.split.rules import (
    CONCAT, STAGED, NodeInfo, SliceOn, SplitAxis, SplitOption, UnsplittableOpError, Whole, constant_values, find_option,
    is_exact, split_options,
)
from graph_passes.planning.split.reduction_order import staged_matches
from graph_passes.planning.split.time_cache import MeasuredTimes
from graph_passes.planning.swap.planner import Infeasible, SwapPlanner, apply_swap_plan, step_requirements
from graph_passes.planning.workers import ForkedMap, default_workers

logger = logging.getLogger(__name__)

SPLIT_PARTS = (2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """One split the planner took: ``node`` (its name, else its first output) ``parts`` ways on ``axis``; the op needed
    ``needed_before`` bytes, its split needs ``needed_after``; ``added_time_s`` is Eq. 6. ``exact``: no output is a
    sum of partial results (the split node computes the op's bits)."""

    node: str
    axis: SplitAxis
    parts: int
    needed_before: int
    needed_after: int
    added_time_s: float
    exact: bool = True

    @property
    def saved_bytes(self) -> int:
        return self.needed_before - self.needed_after


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """The splits (``split``, in the order taken, with ``choices``) and what the check found:
    ``required_bytes`` (least budget any swap plan of the split graph needs) and
    ``checked_peak_bytes`` (the arena replay of its one-node-per-block swap plan)."""

    split: SplitPlan
    choices: tuple[SplitChoice, ...]
    budget: int
    required_bytes: int
    checked_peak_bytes: int

    @property
    def added_time_s(self) -> float:
        return sum(c.added_time_s for c in self.choices)

    @property
    def exact(self) -> bool:
        """Every split is exact: the split graph computes the unsplit graph's bits."""
        return all(c.exact for c in self.choices)


@dataclasses.dataclass(frozen=True)
class _Tried:
    """One candidate split of an op written into the graph: ``rewrite`` is (graph, infos,
    lowering), None where the op cannot be split so; ``group`` its nodes in the graph (the
    split's micro-ops, cuts and merges); ``after`` the most a step running one of them needs
    (the lowering's views and merges included); ``fits`` where that is less than the op needed
    and within the budget."""

    option: SplitOption
    run: SplitRun
    rewrite: tuple | None
    group: frozenset[int]
    after: int
    fits: bool

    @staticmethod
    def of(option: SplitOption, run: SplitRun, rewrite, tag: re.Pattern, need: int, budget: int,
           sizes_of: Callable[[Mapping[str, TensorInfo]], dict[str, int]]) -> "_Tried":
        if rewrite is None:
            return _Tried(option, run, None, frozenset(), need, False)
        rewritten, new_infos, program = rewrite
        group = frozenset(i for i, n in enumerate(rewritten.graph.node) if tag.search(n.name))
        sizes = sizes_of(new_infos)
        after = max((step_need for i, step_need in step_requirements(program, sizes)
                     if isinstance(program.steps[i], RunBlock)
                     and group & set(program.blocks[program.steps[i].block].node_indices)), default=need)
        return _Tried(option, run, rewrite, group, after, after < need and after <= budget)


@dataclasses.dataclass(frozen=True)
class Bottleneck:
    """Why no plan fits: ``node`` (op type ``op_type``; empty for a load or fetch) needs
    ``needed_bytes`` at best, more than the budget."""

    node: str
    op_type: str
    needed_bytes: int
    reason: str


@dataclasses.dataclass
class SplitMemo:
    """What :class:`JointPlanner` works out the same at every budget for one graph and signature,
    kept across planners where one signature is planned at many budgets (the least-budget
    search): each split plan's rewritten graph, infos and lowering, and measured node times."""

    rewrites: dict = dataclasses.field(default_factory=dict)  # (id(model), id(infos), plan) -> (model, infos, rewrite)
    measured: MeasuredTimes = dataclasses.field(default_factory=lambda: MEASURED)  # node signature -> seconds


# Node times measured in ONNX Runtime (None: not measurable alone), by node signature, for every
# planner of the process and kept on disk for later ones (time_cache): a signature measured once
# keeps its time, so the same graph, signature and budget get the same split plan again (the
# least budget stated is the one a run plans with, in this process and the next).
MEASURED = MeasuredTimes()


class JointPlanner:
    """Alg. 2 over split and swap for one input signature.

    ``lower(model, infos)``: the graph lowered one node per block (the runtime's lowering, so
    views and block rules are the runtime's). ``infer(model)``: tensor infos of a rewritten
    graph. ``cost_model`` times nodes; with ``measure`` the op and its micro-ops are also
    profiled in ONNX Runtime (:func:`graph_passes.planning.split.cost.measure_node_times`, cached by
    node signature) and measured times win."""

    def __init__(
        self, *, lower: Callable[[onnx.ModelProto, Mapping[str, TensorInfo]], Program],
        infer: Callable[[onnx.ModelProto], Mapping[str, TensorInfo]], cost_model: CostModel,
        parts: tuple[int, ...] = SPLIT_PARTS, alignment: int = DEFAULT_ALIGNMENT, measure: bool = False,
        max_splits: int = 256, memo: SplitMemo | None = None, workers: int | None = None,
        staged_reductions: bool = False, threads: int = 0,
    ) -> None:
        self.lower, self.infer, self.cost_model = lower, infer, cost_model
        self.parts, self.alignment, self.measure, self.max_splits = tuple(parts), alignment, measure, max_splits
        # Processes the walk's candidate rewrites run in (None: default_workers(), or 1 where
        # measuring, which profiles in ONNX Runtime in this process).
        self.workers = workers or (1 if measure else default_workers())
        self._walk_workers: tuple | None = None  # (graph, infos, ForkedMap) while plan() walks
        # Plans run on ONNX Runtime's CPU kernels (with ``threads`` intra-op threads): a staged
        # reduction is exact where probed so (graph_passes.planning.split.reduction_order);
        # elsewhere it counts as inexact.
        self.staged_reductions, self.threads = staged_reductions, threads
        self.memo = memo if memo is not None else SplitMemo()
        self._measured: MeasuredTimes = self.memo.measured
        self._profiled: set[tuple] = set()  # signatures this planner charged measured times for
        self.candidates_tried = 0
        self.candidates_skipped = 0  # options not rewritten: they cost what an option tried before them did
        self.profiled = 0  # node signatures charged times measured in ONNX Runtime (measure=True)

    def plan(self, model: onnx.ModelProto, infos: Mapping[str, TensorInfo], budget: int) -> JointPlan | Bottleneck:
        """The split plan that lets every step fit ``budget``, or the op that cannot be made to."""
        try:
            with ForkedMap(functools.partial(self._rewrite, model, infos), self.workers) as workers:
                self._walk_workers = (model, infos, workers)
                return self._walk(model, infos, budget)
        finally:
            self._walk_workers = None
            if self.measure:  # what this walk measured, for the next process (time_cache)
                self._measured.save()

    def _walk(self, model: onnx.ModelProto, infos: Mapping[str, TensorInfo], budget: int) -> JointPlan | Bottleneck:
        names = {_label(n): i for i, n in enumerate(model.graph.node) if _label(n)}
        constants = constant_values(model)
        runs: list[SplitRun] = []
        choices: list[SplitChoice] = []
        current, current_infos = model, infos
        program = self.lower(current, current_infos)
        while True:
            sizes = self._sizes(current_infos)
            over = next(((i, need) for i, need in step_requirements(program, sizes) if need > budget), None)
            if over is None:
                break
            index, need = over
            step = program.steps[index]
            if not isinstance(step, RunBlock):
                return Bottleneck("", "", need, f"step {index} ({type(step).__name__}) alone needs {need} bytes")
            node = max((current.graph.node[i] for i in program.blocks[step.block].node_indices),
                       key=lambda n: sum(current_infos[o].nbytes for o in n.output if o in current_infos))
            if _is_split_node(node) or _label(node) not in names:
                return Bottleneck(_label(node), node.op_type, need, "a micro-op or merge of a split alone exceeds the budget")
            if len(runs) >= self.max_splits:
                return Bottleneck(_label(node), node.op_type, need, f"more than {self.max_splits} splits needed")
            best = self._best_split(model, infos, constants, runs, names[_label(node)], need, budget)
            if isinstance(best, Bottleneck):
                return best
            run, choice, current, current_infos, program = best
            runs.append(run)
            choices.append(choice)
            logger.info("split %s %d ways on %s: needs %d instead of %d bytes, +%.3g ms", choice.node, choice.parts,
                        choice.axis, choice.needed_after, choice.needed_before, choice.added_time_s * 1e3)
        split = SplitPlan(tuple(runs))
        joined = self._joined_plan(model, infos, constants, split, budget)
        if joined is not None:
            split, (_, current_infos, program) = joined
        return self._check(split, tuple(choices), program, current_infos, budget)

    def _joined_plan(self, model, infos, constants, split: SplitPlan, budget: int):
        """``split`` with readers taken into its runs (:func:`absorb_readers`) and its runs
        chained (:func:`chain_runs`), else with its runs chained only, and the rewrite: the
        first that changes the plan and fits; None where neither does."""
        exact = functools.partial(self._exact, infos=infos)
        absorbed = absorb_readers(model, infos, constants, split, exact)
        candidates = [chain_runs(model, infos, constants, absorbed)] if absorbed != split else []
        candidates.append(chain_runs(model, infos, constants, split))
        return next((found for found in (self._joined(model, infos, c, split, budget) for c in candidates)
                     if found is not None), None)

    def _joined(self, model, infos, joined: SplitPlan, split: SplitPlan, budget: int):
        """``joined`` and its rewrite, where it differs from ``split``, rewrites and still fits
        ``budget`` step by step; else None."""
        if joined == split:
            return None
        try:
            rewrite = self.rewritten(model, infos, joined)
        except ValueError as e:  # e.g. a node outside a run between two of its nodes
            logger.info("split runs not joined: %s", e)
            return None
        if rewrite is None:
            return None
        sizes = self._sizes(rewrite[1])
        if any(need > budget for _, need in step_requirements(rewrite[2], sizes)):
            return None
        logger.info("split runs joined: %d runs of %d nodes", len(joined.runs), joined.split_nodes)
        return joined, rewrite

    def _sizes(self, infos: Mapping[str, TensorInfo]) -> dict[str, int]:
        return {n: align_up(i.nbytes, self.alignment) for n, i in infos.items()}

    def _best_split(self, model, infos, constants, runs, index, need, budget):
        """The cheapest split (exact first, then lowest ΔT/ΔM) of node ``index`` that makes it
        fit, with the rewritten graph, its infos and lowering; or the Bottleneck."""
        node = model.graph.node[index]
        try:
            options = split_options(NodeInfo.of(node, infos, constants))
        except UnsplittableOpError as e:
            return Bottleneck(_label(node), node.op_type, need, str(e))
        tag = re.compile(rf"__sp{len(runs)}(?!\d)")
        run_axes = None if self.measure else _RunAxes.of(model, infos, constants, runs)  # measured: every axis
        exact = [o for o in options if self._exact(node, o, infos=infos)]
        exact_ids = {id(o) for o in exact}
        tried = self._tried(model, infos, runs, index, self._one_per_class(node, exact, infos, run_axes), tag, need, budget)
        if not any(t.fits for t in tried):  # no exact split fits: a sum of partial results may
            inexact = [o for o in options if id(o) not in exact_ids]
            tried += self._tried(model, infos, runs, index, self._one_per_class(node, inexact, infos, run_axes), tag,
                                 need, budget)
        best, least = None, need
        for t in tried:
            if t.rewrite is None:
                continue
            least = min(least, t.after)
            if not t.fits:
                continue
            rewritten, new_infos, program = t.rewrite
            wholes = {w for w, _ in program.views}
            views = [n.name for i, n in enumerate(rewritten.graph.node)
                     if i in t.group and n.op_type == "Split" and n.input[0] in wholes]
            group_nodes = [rewritten.graph.node[i] for i in sorted(t.group)]
            cost_model = self._cost_model(node, model, infos, group_nodes, new_infos, rewritten)
            added = split_added_time(node, infos, group_nodes, new_infos, cost_model, views=views)
            is_exact_option = id(t.option) in exact_ids
            rank = (not is_exact_option, added / (need - t.after), t.run.parts)
            if best is None or rank < best[0]:  # the first tried keeps a tie
                choice = SplitChoice(_label(node), t.option.key, t.run.parts, need, t.after, added, is_exact_option)
                best = (rank, (t.run, choice, rewritten, new_infos, program))
        if best is None:
            return Bottleneck(_label(node), node.op_type, least,
                              f"no split of {node.op_type} {_label(node)!r} (p in {self.parts}) brings its {need} bytes "
                              f"under the budget {budget}; the best needs {least}")
        return best[1]

    def _exact(self, node: onnx.NodeProto, option: SplitOption, *, infos: Mapping[str, TensorInfo]) -> bool:
        """Whether ``option`` computes ``node``'s own bits: :func:`is_exact`, or a staged
        reduction whose order ONNX Runtime's CPU kernel was probed to share."""
        return is_exact(option) or (self.staged_reductions and staged_exact(node, infos, option, self.parts,
                                                                            self.threads))

    def _one_per_class(self, node, options, infos, run_axes) -> list[SplitOption]:
        """``options`` less those in the cost class of one before them (:func:`_cost_class`;
        ``run_axes`` None: every option is its own class)."""
        classes: set[tuple] = set()
        kept = []
        for option in options:
            same = None if run_axes is None else _cost_class(node, option, infos, run_axes)
            if same is not None:
                if same in classes:
                    self.candidates_skipped += 1  # ties with one tried before it, which keeps the tie
                    continue
                classes.add(same)
            kept.append(option)
        return kept

    def _tried(self, model, infos, runs, index, options, tag, need, budget) -> list["_Tried"]:
        """Each option split into ``p`` in :attr:`parts` from the fewest up (at most its extent)
        until one makes the op fit (more parts: more launches, same op), in the order of
        ``options`` and then ``p``. Every round of rewrites (each open option's next ``p``) runs
        side by side in :attr:`workers` processes; which rewrites are made does not depend on
        how many."""
        open_parts = {k: [p for p in self.parts if p <= option.extent] for k, option in enumerate(options)}
        open_parts = {k: parts for k, parts in open_parts.items() if parts}
        tried: list[tuple[int, _Tried]] = []
        while open_parts:
            round_ = [(k, parts.pop(0)) for k, parts in open_parts.items()]
            runs_tried = [SplitRun((index,), (options[k].key,), p) for k, p in round_]
            self.candidates_tried += len(runs_tried)
            rewrites = self._rewrites(model, infos, [SplitPlan((*runs, run)) for run in runs_tried])
            for (k, _), run, rewrite in zip(round_, runs_tried, rewrites):
                result = _Tried.of(options[k], run, rewrite, tag, need, budget, self._sizes)
                tried.append((k, result))
                if result.fits or not open_parts[k]:
                    del open_parts[k]
        return [t for _, t in sorted(tried, key=lambda kt: (kt[0], kt[1].run.parts))]

    def rewritten(self, model: onnx.ModelProto, infos, plan: SplitPlan):
        """(graph, infos, one-node-per-block lowering) of ``model`` split by ``plan``; None where
        an op of it cannot be split so. Kept in the memo."""
        return self._rewrites(model, infos, [plan])[0]

    def _rewrites(self, model: onnx.ModelProto, infos, plans: list[SplitPlan]) -> list:
        """:meth:`rewritten` for each plan; those not in the memo made side by side (the walk's
        workers, where ``model`` is the walk's graph) and kept there."""
        keys = [(id(model), id(infos), plan) for plan in plans]
        missing = [plan for key, plan in zip(keys, plans) if key not in self.memo.rewrites]
        walk = self._walk_workers
        if walk is not None and walk[0] is model and walk[1] is infos:
            made = walk[2].map(missing)
        else:
            made = [self._rewrite(model, infos, plan) for plan in missing]
        for plan, rewrite in zip(missing, made):
            self.memo.rewrites[(id(model), id(infos), plan)] = (model, infos, rewrite)  # holding both keeps their ids
        return [self.memo.rewrites[key][2] for key in keys]

    def _rewrite(self, model: onnx.ModelProto, infos, plan: SplitPlan):
        """:meth:`rewritten`, not memoised (what a worker runs)."""
        try:
            rewritten, _ = write_split_plan(model, plan, infos, cut=Cut.SPLIT)
        except UnsplittableOpError:
            return None
        new_infos = self.infer(rewritten)
        return rewritten, new_infos, self.lower(rewritten, new_infos)

    def _cost_model(self, node, model, infos, group_nodes, new_infos, rewritten) -> CostModel:
        """The cost model charging ``node`` (of ``model``) and its micro-ops (of ``rewritten``)
        their times measured here, each run in its own graph's constants."""
        if not self.measure:
            return self.cost_model
        times = {}
        for n, n_infos, m in [(node, infos, model)] + [(g, new_infos, rewritten) for g in group_nodes]:
            key = _signature(n, n_infos)
            if key not in self._measured:
                self._measured[key] = measure_node_times(m, [n], n_infos).get(n.name)
            if self._measured[key] is None:  # not measurable alone: the cost model's time
                times[n.name] = self.cost_model.node_time(n, n_infos)
            else:
                times[n.name] = self._measured[key]
                self.profiled += key not in self._profiled
                self._profiled.add(key)
        return ProfiledCostModel({}, self.cost_model, node_times=times)

    def _check(self, split: SplitPlan, choices, program: Program, infos, budget: int) -> JointPlan | Bottleneck:
        """Swap-plan the split graph (one node per block) and replay it under the budget."""
        sizes = self._sizes(infos)
        swap = SwapPlanner().plan(program, sizes, budget)
        if isinstance(swap, Infeasible):
            return Bottleneck("", "", swap.needed_bytes, swap.reason)
        planned = apply_swap_plan(program, swap)
        trace = simulate_program(planned, infos, budget=budget, alignment=self.alignment)
        if trace.peak_device_bytes > budget:
            return Bottleneck("", "", trace.peak_device_bytes, "the swap plan of the split graph does not replay within the budget")
        required = max((need for _, need in step_requirements(program, sizes)), default=0)
        return JointPlan(split, choices, budget, required, trace.peak_device_bytes)


def chain_runs(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], constants, split: SplitPlan) -> SplitPlan:
    """``split`` with a run joined to the run after it wherever the first run's last node makes
    a value that only the next run's first node reads, cut the same ``p`` ways along the axis
    the first merges it on (TSPLIT's micro-tensors flowing op to op). The value then never
    exists whole: no ``Concat`` (pieces and whole live together, twice its bytes) and no
    second cut of it. At a budget barely above an op's need, such a merge needs the whole
    budget and sends every other live value out and back (cnn small at its least budget: a
    BatchNorm's four elementwise ops, each split alone, merged three times)."""
    nodes = model.graph.node
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, set()).add(index)
    outputs = {o.name for o in model.graph.output}
    runs = sorted(split.runs, key=lambda r: r.nodes[0])  # node order is topological
    by_first = {run.nodes[0]: run for run in runs}
    absorbed: set[SplitRun] = set()
    result = []
    for run in runs:
        if run in absorbed:
            continue
        while (following := _following_run(nodes, infos, constants, run, readers, outputs, by_first)) is not None \
                and following not in absorbed:
            absorbed.add(following)
            run = SplitRun(run.nodes + following.nodes, run.axes + following.axes, run.parts)
        result.append(run)
    return SplitPlan(tuple(result)) if absorbed else split


def _following_run(nodes, infos, constants, run: SplitRun, readers, outputs, by_first) -> SplitRun | None:
    """The run whose first node alone reads one of ``run``'s last node's outputs as the same
    pieces ``run`` cuts it into (see :func:`chain_runs`), or None."""
    last = nodes[run.nodes[-1]]
    made = find_option(NodeInfo.of(last, infos, constants), run.axes[-1])
    for name, merge in zip(last.output, made.outputs):
        users = readers.get(name, set())
        if name in outputs or len(users) != 1 or merge.kind != CONCAT:
            continue
        following = by_first.get(next(iter(users)))
        if following is None or following.parts != run.parts:
            continue
        reader = nodes[following.nodes[0]]
        option = find_option(NodeInfo.of(reader, infos, constants), following.axes[0])
        slots = [k for k, n in enumerate(reader.input) if n == name]
        if option.extent == made.extent and all(option.inputs[k] == SliceOn(merge.axis) for k in slots):
            return following
    return None


def _label(node: onnx.NodeProto) -> str:
    """A node's name, or its first output for an unnamed node."""
    return node.name or next((o for o in node.output if o), "")


@dataclasses.dataclass(frozen=True)
class _RunAxes:
    """The axes on which earlier runs merge (Concat) or cut (slice) each value: a later split
    on the same axis shares their micro-tensors (:class:`~graph_passes.planning.split.graph_pass._MergedPieces`),
    on any other axis it does not."""

    merged: Mapping[str, frozenset[int]]
    cut: Mapping[str, frozenset[int]]

    @staticmethod
    def of(model: onnx.ModelProto, infos, constants, runs) -> "_RunAxes":
        merged: dict[str, set[int]] = {}
        cut: dict[str, set[int]] = {}
        for run in runs:
            for index, key in zip(run.nodes, run.axes):
                node = model.graph.node[index]
                option = find_option(NodeInfo.of(node, infos, constants), key)
                for name, part in zip(node.input, option.inputs):
                    if isinstance(part, SliceOn):
                        cut.setdefault(name, set()).add(part.axis)
                for name, merge in zip(node.output, option.outputs):
                    if merge.kind == CONCAT:
                        merged.setdefault(name, set()).add(merge.axis)
        return _RunAxes({n: frozenset(a) for n, a in merged.items()}, {n: frozenset(a) for n, a in cut.items()})


def _cost_class(node: onnx.NodeProto, option: SplitOption, infos: Mapping[str, TensorInfo],
                runs: _RunAxes) -> tuple | None:
    """What ``option``'s ΔM and analytical ΔT depend on besides its axis, where they depend on
    nothing else; None where they may. Then every input is sliced or read whole and every
    output concatenated; no sliced input can be a view (a view needs only size-1 dims before
    the axis); and no sliced input is merged, and no output cut, by an earlier run on the
    option's axis (micro-tensors are shared per axis). Two such options with one class write
    the same nodes on other axes: the same bytes per step and, in a roofline, the same times,
    so the same rank, and the first tried keeps a tie. Elementwise ops on NCHW tensors offer
    four axes, two or three of them alike."""
    if option.key.merge != CONCAT or any(m.kind != CONCAT for m in option.outputs):
        return None
    if any(m.axis in runs.cut.get(name, ()) for name, m in zip(node.output, option.outputs)):
        return None
    sliced = []
    for name, part in zip(node.input, option.inputs):
        if isinstance(part, Whole):
            sliced.append(None)
        elif (isinstance(part, SliceOn) and name in infos and part.axis not in runs.merged.get(name, ())
              and any(d != 1 for d in infos[name].shape[:part.axis])):
            sliced.append(infos[name].nbytes)
        else:
            return None
    return option.op_type, option.attributes, option.extent, tuple(sliced), len(option.outputs)


def staged_exact(node: onnx.NodeProto, infos: Mapping[str, TensorInfo], option: SplitOption,
                 parts: tuple[int, ...], threads: int = 0) -> bool:
    """Whether ``option``, a staged reduction, gives ``node``'s bits on ONNX Runtime's CPU
    kernels for every count of ``parts`` (probed, at ``threads`` intra-op threads and the usual
    counts)."""
    staged = [m for m in option.outputs if m.kind == STAGED]
    x = infos.get(node.input[0])
    if len(staged) != 1 or len(option.outputs) != 1 or x is None:
        return False
    merge = staged[0]
    return staged_matches(node.op_type, x.shape, x.dtype.str, merge.reduce_axes, merge.keepdims, merge.axis, parts,
                          threads)


def _is_split_node(node: onnx.NodeProto) -> bool:
    return any(p.key == PASS_KEY and p.value == PASS_NAME for p in node.metadata_props)


def _signature(node: onnx.NodeProto, infos: Mapping[str, TensorInfo]) -> tuple:
    shapes = tuple((infos[n].dtype.str, infos[n].shape) if n in infos else None for n in node.input)
    return node.op_type, node.domain, tuple(a.SerializeToString() for a in node.attribute), shapes


def split_node_count(model: onnx.ModelProto) -> int:
    """Nodes the split pass added to ``model`` (micro-ops, cuts, merges, their constants)."""
    return sum(1 for n in model.graph.node if _is_split_node(n))


__all__ = ["Bottleneck", "JointPlan", "JointPlanner", "SPLIT_PARTS", "SplitChoice", "SplitMemo", "split_node_count",
           "staged_exact"]
