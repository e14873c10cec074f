"""What a planner chooses for one signature: a program, its memory trace and how it was made."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import onnx
import onnx_ir.passes

from graph_passes.ir.memory import MemoryTrace
from graph_passes.ir.program import Program
from graph_passes.ir.shapes import TensorInfo


@dataclasses.dataclass(frozen=True)
class ProgramChoice:
    """A program that fits the budget: ``passes`` it applies; ``base_program`` is the lowering a
    swap plan was made for (the program itself where nothing was swapped)."""

    program: Program
    trace: MemoryTrace
    passes: tuple[str, ...] = ()
    base_program: Program | None = None
    swap_plan: object = None  # the swap planner's SwapPlan (untyped here: swap and recompute share this type)

    @property
    def base(self) -> Program:
        return self.base_program if self.base_program is not None else self.program

    def with_passes(self, passes: tuple[str, ...]) -> "ProgramChoice":
        return dataclasses.replace(self, passes=passes)


@dataclasses.dataclass(frozen=True)
class RewriteOutcome:
    """A pass's rewrite of the graph and what was planned on it: the rewritten ``model`` and its
    ``infos``, the lowerings tried (a swap plan may start from them), the ``choice`` if one fits,
    the nodes the rewrite added, the least budget seen, and the ``rewrites``: the passes that
    turn the target's graph into ``model`` (none where it is the target's own)."""

    model: onnx.ModelProto
    infos: Mapping[str, TensorInfo]
    choice: ProgramChoice | None
    added_nodes: int
    needed_bytes: int
    programs: tuple[Program, ...] = ()
    rewrites: tuple[onnx_ir.passes.PassBase, ...] = ()


@dataclasses.dataclass(frozen=True)
class Infeasible:
    """No plan fits: the least budget any plan tried needs, and what was offered."""

    needed_bytes: int
    budget_bytes: int
    passes: tuple[str, ...]
    bottleneck: str = ""  # where splitting stopped, when it was tried
    unplanned_bytes: int = 0  # least budget of the graph with no pass applied (0: not known)
