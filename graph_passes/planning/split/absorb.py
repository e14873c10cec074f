"""Readers taken into the split runs, so that a run's output need never exist whole.

The split planner splits only the ops that exceed the budget. A run's output read by a node
outside every run is merged (``Concat``): pieces and whole live together, twice its bytes, and
at a budget barely above an op's need that takes the whole budget and sends every other live
value out and back. Where every reader outside the runs can be split the same way, exactly,
and makes little (a reduction: a BatchNorm's statistics of a split Conv's output, with its
staged split), :func:`absorb_readers` gives each a run of its own; the split pass then hands
them the producer's pieces (:func:`~graph_passes.planning.split.planner.chain_runs` for a sole
reader, shared pieces otherwise) and drops the merge no node reads any more.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import onnx

from graph_passes.ir.shapes import TensorInfo
from graph_passes.planning.split.graph_pass import SplitPlan, SplitRun
from graph_passes.planning.split.rules import (
    CONCAT, NodeInfo, SliceOn, SplitOption, UnsplittableOpError, find_option, split_options,
)

# A reader's output is small where it is at most this share of what the reader reads from the
# runs: its own merge then costs little. A larger output is merged too, unless its readers are
# taken in as well, at most MAX_DEPTH readers down.
SMALL_SHARE = 16
MAX_DEPTH = 3
SHAPE_READERS = ("Shape", "Size")  # the split pass folds them into constants (_MergedPieces)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """How a run merges one of its outputs: on ``axis`` (of ``extent``) into ``parts`` pieces."""

    axis: int
    extent: int
    parts: int


@dataclasses.dataclass
class _Absorbing:
    """What one value's readers taken in add: their runs, and the cuts of their outputs."""

    runs: dict[int, tuple[SplitRun, SplitOption]]
    cuts: dict[str, _Cut]

    def copy(self) -> "_Absorbing":
        return _Absorbing(dict(self.runs), dict(self.cuts))


class _Graph:
    """The graph, its runs and readers, for :func:`absorb_readers`."""

    def __init__(self, model: onnx.ModelProto, infos, constants, split: SplitPlan, exact) -> None:
        self.nodes, self.infos, self.constants, self.exact = model.graph.node, infos, constants, exact
        self.placed = {i: (run, self.option(i, key)) for run in split.runs for i, key in zip(run.nodes, run.axes)}
        self.readers: dict[str, set[int]] = {}
        for index, node in enumerate(self.nodes):
            for name in node.input:
                self.readers.setdefault(name, set()).add(index)
        self.graph_outputs = {o.name for o in model.graph.output}

    def option(self, index: int, key) -> SplitOption:
        return find_option(NodeInfo.of(self.nodes[index], self.infos, self.constants), key)

    def merged_outputs(self) -> dict[str, _Cut]:
        """Every run output the runs merge by Concat, with its cut."""
        return {name: _Cut(merge.axis, option.extent, run.parts)
                for index, (run, option) in self.placed.items()
                for name, merge in zip(self.nodes[index].output, option.outputs) if name and merge.kind == CONCAT}


def absorb_readers(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], constants, split: SplitPlan,
                   exact: Callable[[onnx.NodeProto, SplitOption], bool]) -> SplitPlan:
    """``split`` with a one-node run for each reader outside the runs of a merged run output,
    where every such reader can be split as the run cuts it (``exact`` options only) and makes
    little or has readers that can be taken in too, and the readers inside the runs read its
    pieces as they are."""
    graph = _Graph(model, infos, constants, split, exact)
    taken = _Absorbing({}, graph.merged_outputs())
    for name, cut in list(taken.cuts.items()):
        trial = taken.copy()
        if _take_readers(graph, name, cut, trial, depth=0):
            taken = trial
    if not taken.runs:
        return split
    return SplitPlan(split.runs + tuple(taken.runs[i][0] for i in sorted(taken.runs)))


def _take_readers(graph: _Graph, name: str, cut: _Cut, taken: _Absorbing, depth: int) -> bool:
    """Take every reader of ``name`` outside the runs into ``taken``; False where one cannot be."""
    if name in graph.graph_outputs:
        return False
    for index in sorted(graph.readers.get(name, ())):
        node = graph.nodes[index]
        placed = graph.placed.get(index) or taken.runs.get(index)
        if placed is not None:
            if not _reads_pieces(node, *placed, name, cut):
                return False
        elif not (node.domain == "" and node.op_type in SHAPE_READERS) and not _take(graph, index, cut, taken, depth):
            return False
    return True


def _take(graph: _Graph, index: int, cut: _Cut, taken: _Absorbing, depth: int) -> bool:
    """Take reader ``index`` in, split as ``cut``, with the readers of its large outputs."""
    node = graph.nodes[index]
    option = _reader_option(graph, node, cut, taken.cuts)
    if option is None:
        return False
    taken.runs[index] = (SplitRun((index,), (option.key,), cut.parts), option)
    read = sum(graph.infos[n].nbytes for n in set(node.input) if n in taken.cuts and n in graph.infos)
    for name, merge in zip(node.output, option.outputs):
        if not name or name not in graph.infos:
            continue
        if merge.kind == CONCAT:
            taken.cuts[name] = _Cut(merge.axis, option.extent, cut.parts)
        if graph.infos[name].nbytes * SMALL_SHARE <= read:
            continue
        if merge.kind != CONCAT or depth >= MAX_DEPTH or not _take_readers(graph, name, taken.cuts[name], taken,
                                                                            depth + 1):
            return False
    return True


def _reads_pieces(node: onnx.NodeProto, run: SplitRun, option: SplitOption, name: str, cut: _Cut) -> bool:
    """Whether run node ``node`` reads ``name`` as ``cut``'s pieces (or makes it)."""
    if name in node.output:
        return True
    return run.parts == cut.parts and option.extent == cut.extent and all(
        option.inputs[k] == SliceOn(cut.axis) for k, n in enumerate(node.input) if n == name)


def _reader_option(graph: _Graph, node: onnx.NodeProto, cut: _Cut, cuts: Mapping[str, _Cut]) -> SplitOption | None:
    """An exact option of ``node`` reading every merged input as its pieces, or None."""
    try:
        options = split_options(NodeInfo.of(node, graph.infos, graph.constants))
    except UnsplittableOpError:
        return None
    for option in options:
        if option.extent == cut.extent and graph.exact(node, option) and all(
                option.inputs[k] == SliceOn(cuts[n].axis) and cuts[n].parts == cut.parts
                and cuts[n].extent == cut.extent for k, n in enumerate(node.input) if n in cuts):
            return option
    return None


__all__ = ["MAX_DEPTH", "SMALL_SHARE", "absorb_readers"]
