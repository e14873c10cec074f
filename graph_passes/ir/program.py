"""Lowering of a training-step graph into a program of execution blocks and memory steps.

The schedule (a topological order of nodes) is cut into execution blocks of consecutive nodes;
each block becomes one ONNX Runtime session in the runtime. Values crossing block boundaries
live in the device arena; values born and dead inside one block are the block's workspace
(ONNX Runtime allocates them while the block runs). The program says, in order, what the
runtime does each step: load a batch tensor, run a block (its outputs are allocated first),
free values after their last use, fetch outputs to the host, and commit updated state as the
next step's input. Pure data: the runtime executes it, :mod:`graph_passes.ir.memory` replays it.

Split views (TSPLIT: a split on a contiguous leading axis is an offset view). A ``Split`` node
written by the split pass (:mod:`graph_passes.planning.split.graph_pass`) whose axis has only size-1 dims
before it, whose piece boundaries fall on the arena alignment, and whose input is a node output
read by nothing else, runs no kernel: its producer's output is allocated as the pieces, placed
back to back (:attr:`Program.views`), and each piece is freed at its own last use. The Split's
position becomes a block boundary, so the pieces always cross into the arena.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

import onnx

from graph_passes.ir.liveness import INPUT_POSITION, NodeIO, check_topological, consumed_names, node_io, positions
from graph_passes.ir.allocator import DEFAULT_ALIGNMENT
from graph_passes.ir.provenance import PASS_KEY, SPLIT_PASS
from graph_passes.ir.shapes import TensorInfo
from graph_passes.errors import UnsupportedGraphError

DEFAULT_BLOCK_NODES = 256


@dataclasses.dataclass(frozen=True)
class Block:
    """Consecutive nodes run as one session: reads ``inputs``, writes ``outputs`` to the arena."""

    index: int
    node_indices: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    workspace_bytes: int


@dataclasses.dataclass(frozen=True)
class Load:
    """Allocate a batch tensor in the arena and copy it in from the host."""

    name: str


@dataclasses.dataclass(frozen=True)
class RunBlock:
    """Allocate the block's outputs, run it, then free what it read for the last time."""

    block: int
    allocates: tuple[str, ...]
    frees: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Fetch:
    """Copy a graph output to the host and free it (unless it is state kept for the next step)."""

    name: str
    free: bool


@dataclasses.dataclass(frozen=True)
class Commit:
    """Updated state takes its input's name for the next step (no copy: the arena entry is renamed)."""

    renames: tuple[tuple[str, str], ...]  # (updated output, state input)


@dataclasses.dataclass(frozen=True)
class SwapOut:
    """Move a tensor from the arena to the host store and free it in the arena. ``copy=False``
    drops it instead: the host already holds the same bytes (tensors are immutable values)."""

    name: str
    copy: bool = True


@dataclasses.dataclass(frozen=True)
class SwapIn:
    """Bring a tensor back from the host store into the arena (the host copy stays, clean)."""

    name: str


Step = Union[Load, RunBlock, Fetch, Commit, SwapOut, SwapIn]


@dataclasses.dataclass(frozen=True)
class Program:
    blocks: tuple[Block, ...]
    steps: tuple[Step, ...]
    state_inputs: tuple[str, ...]  # resident across steps, in placement order
    data_inputs: tuple[str, ...]
    fetches: tuple[str, ...]  # outputs returned to the caller
    host_state: tuple[str, ...] = ()  # state kept in the host store between steps (swap plans)
    # Split views: (whole value a block writes, its pieces in order). The block allocates the
    # pieces back to back and writes the whole value over them; the pieces live on alone.
    views: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def max_workspace_bytes(self) -> int:
        return max((b.workspace_bytes for b in self.blocks), default=0)


_REDUCING_SCATTERS = ("ScatterND", "ScatterElements")


def is_order_dependent(node: onnx.NodeProto) -> bool:
    """A node whose result depends on the order threads accumulate in: a scatter that reduces
    duplicate indices (the embedding gradient). ONNX Runtime runs it differently from run to
    run with several threads, so the runtime gives it a single-threaded block of its own."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in _REDUCING_SCATTERS:
        return False
    reduction = next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")
    return reduction != "none"


def order_dependent_closure(nodes: Sequence[onnx.NodeProto], io: Sequence[NodeIO], order: Sequence[int]) -> set[int]:
    """Indices of the order-dependent nodes and of every node that reads what they make
    (transitively), walking ``nodes`` in the topological ``order``."""
    tainted: set[str] = set()
    closure: set[int] = set()
    for index in order:
        if (tainted and any(name in tainted for name in io[index].reads)) or is_order_dependent(nodes[index]):
            tainted.update(io[index].outputs)
            closure.add(index)
    return closure


def order_dependent_last(model: onnx.ModelProto, io: Sequence[NodeIO] | None = None) -> list[int] | None:
    """A schedule that runs order-dependent nodes (and everything that depends on them) after
    all other nodes, so the rest stays one multi-threaded block; None if there are none.
    ``io``: the nodes' :func:`~graph_passes.ir.liveness.node_io`, when the caller has it."""
    nodes = list(model.graph.node)
    late = order_dependent_closure(nodes, io if io is not None else node_io(nodes), range(len(nodes)))
    if not late:
        return None
    return [i for i in range(len(nodes)) if i not in late] + sorted(late)


def program_order(model: onnx.ModelProto, program: Program, io: Sequence[NodeIO] | None = None) -> list[int]:
    """Every node of ``model`` in the order ``program`` runs them: its blocks' nodes, with the
    nodes no block runs (split views' ``Split`` nodes and the constants only they read) put back
    as soon as what they read exists. A schedule built from the blocks alone lacks them, and
    the pieces' readers then read values nothing makes: lowering it again fails."""
    nodes = model.graph.node
    ran = [i for block in program.blocks for i in block.node_indices]
    pending = sorted(set(range(len(nodes))) - set(ran))
    if not pending:
        return ran
    io = io if io is not None else node_io(nodes)
    made = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}
    order: list[int] = []

    def place(indices) -> None:
        for index in indices:
            order.append(index)
            made.update(io[index].outputs)

    def place_ready() -> None:
        while ready := [k for k in pending if all(n in made for n in io[k].inputs)]:
            pending[:] = [k for k in pending if k not in ready]
            place(ready)

    place_ready()
    for index in ran:
        place((index,))
        place_ready()
    if pending:
        raise ValueError(f"node {pending[0]} ({nodes[pending[0]].op_type}) reads a value the program never makes")
    return order


def partition(num_nodes: int, max_block_nodes: int = DEFAULT_BLOCK_NODES) -> list[tuple[int, ...]]:
    """Cut positions ``0..num_nodes-1`` into consecutive chunks of at most ``max_block_nodes``,
    sized evenly so the last block is not a sliver."""
    if num_nodes == 0:
        return []
    count = -(-num_nodes // max(1, max_block_nodes))
    bounds = [round(i * num_nodes / count) for i in range(count + 1)]
    return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]


def lower(
    model: onnx.ModelProto,
    infos: Mapping[str, TensorInfo],
    *,
    state_pairs: Mapping[str, str],
    data_inputs: Sequence[str],
    fetches: Sequence[str] | None = None,
    max_block_nodes: int = DEFAULT_BLOCK_NODES,
    schedule: Sequence[int] | None = None,
    swap_points=None,
    extra_cuts: Sequence[int] = (),
    alignment: int = DEFAULT_ALIGNMENT,
    io: Sequence[NodeIO] | None = None,
) -> Program:
    """Lower ``model`` into blocks and steps for one input signature (``infos``).

    ``io``: ``node_io(model.graph.node)``, for a caller that lowers one model many times
    (reading the protos is most of a lowering's time).

    ``swap_points`` (:class:`graph_passes.planning.swap.nodes.SwapPoints`, for a graph whose swap nodes
    were read back) adds swap steps at fixed node positions; blocks are cut there.
    ``extra_cuts`` are more block boundaries (positions in the schedule), e.g. from
    :func:`graph_passes.planning.partition.fit_blocks`. Split views (see the module docstring) need
    piece boundaries on ``alignment``."""
    graph = model.graph
    order = list(range(len(graph.node))) if schedule is None else list(schedule)
    initializers = {t.name for t in graph.initializer}
    graph_inputs = [v.name for v in graph.input if v.name not in initializers]
    seen = _lowering_nodes(model, infos, order, swap_points, alignment, io)
    check_topological([seen.nodes[i] for i in order], set(graph_inputs) | initializers, [seen.io[i] for i in order])
    outputs = [o.name for o in graph.output]
    fetches = tuple(fetches if fetches is not None else [o for o in outputs if o not in state_pairs.values()])
    state_inputs = tuple(n for n in graph_inputs if n not in set(data_inputs))

    chunks = _block_chunks(model, seen, order, swap_points, extra_cuts, max_block_nodes)
    live = _block_liveness(seen, order, chunks)
    layout = _layout_blocks(seen, order, chunks, live, initializers, set(outputs), infos)
    persistent = {n for n in state_inputs if n not in state_pairs}  # state nothing replaces
    steps = _block_steps(layout, chunks, live, graph_inputs, data_inputs, set(outputs), persistent,
                         swap_points, seen.io)
    steps += _end_steps(swap_points, len(order), fetches, state_pairs)
    renames = tuple((out, inp) for inp, out in state_pairs.items())
    _check_state_updates(renames, infos)
    if renames:
        steps.append(Commit(renames))
    host_state = tuple(swap_points.host_state) if swap_points else ()
    return Program(
        layout.blocks, tuple(steps), tuple(n for n in state_inputs if n not in host_state),
        tuple(n for n in graph_inputs if n in set(data_inputs)), fetches, host_state,
        tuple(seen.views[i] for i in sorted(seen.views, key=order.index)),
    )


@dataclasses.dataclass(frozen=True)
class _LoweringNodes:
    """The nodes liveness and blocks see, with their reads and writes, and the split views.

    With views, each view Split is nothing and its pieces are its input's producer's outputs
    (the sessions still run the producer writing the whole value); ``graph`` then holds these
    nodes (inputs and outputs kept)."""

    nodes: list[onnx.NodeProto]
    graph: onnx.GraphProto
    io: Sequence[NodeIO]
    views: dict[int, tuple[str, tuple[str, ...]]]


def _lowering_nodes(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], order: Sequence[int],
                    swap_points, alignment: int, io: Sequence[NodeIO] | None) -> _LoweringNodes:
    """The nodes :func:`lower` works on: the model's, or their view surrogate when views apply."""
    graph = model.graph
    nodes = list(graph.node)
    views = {} if swap_points else split_views(model, infos, order, alignment)
    if views:
        nodes, graph = _view_surrogate(graph, nodes, views)
        io = None
    if io is None:
        io = node_io(nodes)
    elif len(io) != len(nodes):
        raise ValueError(f"io describes {len(io)} nodes, the graph has {len(nodes)}")
    return _LoweringNodes(nodes, graph, io, views)


def _block_chunks(model: onnx.ModelProto, seen: _LoweringNodes, order: Sequence[int], swap_points,
                  extra_cuts: Sequence[int], max_block_nodes: int) -> list[tuple[int, ...]]:
    """Schedule positions of each block: cut at swap points, at the caller's ``extra_cuts``,
    around order-dependent nodes and before view Splits, then into chunks of at most
    ``max_block_nodes``; view Splits (and what only they read) are in no block."""
    cuts = {k for k, _ in swap_points.before if 0 < k < len(order)} if swap_points else set()
    cuts |= set(extra_cuts)  # block boundaries chosen by the caller (schedule positions)
    view_positions = set()
    skipped = _view_only(model, seen.views)
    for position, node_index in enumerate(order):
        if is_order_dependent(seen.nodes[node_index]):  # its own block, run single-threaded
            cuts |= {position, position + 1}
        if node_index in seen.views:  # the pieces cross into the arena
            cuts.add(position)
        if node_index in skipped:
            view_positions.add(position)
    cuts = sorted(k for k in cuts if 0 < k < len(order))
    chunks = []
    for start, end in zip([0] + cuts, cuts + [len(order)]):
        chunks += [tuple(start + p for p in chunk) for chunk in partition(end - start, max_block_nodes)]
    if view_positions:  # view Splits run no kernel: in no block
        chunks = [c for c in (tuple(p for p in chunk if p not in view_positions) for chunk in chunks) if c]
    return chunks


@dataclasses.dataclass(frozen=True)
class _BlockLiveness:
    """Liveness at block granularity: the block of each value's birth and of its last use
    (graph inputs at ``INPUT_POSITION``; graph outputs live past the last block)."""

    producer_block: dict[str, int]
    last_block: dict[str, int]


def _block_liveness(seen: _LoweringNodes, order: Sequence[int], chunks: Sequence[tuple[int, ...]]) -> _BlockLiveness:
    block_of_position = {}
    for b, chunk in enumerate(chunks):
        for position in chunk:
            block_of_position[position] = b

    def block_at(position: int) -> int:
        return INPUT_POSITION if position < 0 else block_of_position.get(position, len(chunks))

    birth, last_use = positions(seen.graph, order, seen.io)
    return _BlockLiveness(
        producer_block={n: block_at(p) for n, p in birth.items()},
        last_block={n: block_at(p) for n, p in last_use.items()},
    )


@dataclasses.dataclass(frozen=True)
class _BlockLayout:
    """The blocks, and per block what it allocates in the arena (the pieces, for views)."""

    blocks: tuple[Block, ...]
    allocates: tuple[tuple[str, ...], ...]


def _layout_blocks(seen: _LoweringNodes, order: Sequence[int], chunks: Sequence[tuple[int, ...]],
                   live: _BlockLiveness, initializers: set[str], output_set: set[str],
                   infos: Mapping[str, TensorInfo]) -> _BlockLayout:
    """One :class:`Block` per chunk: what it reads from the arena, what it leaves there (read by a
    later block or a graph output), and its workspace."""
    whole_of = {piece: whole for whole, pieces in seen.views.values() for piece in pieces}
    arena_outputs: list[tuple[str, ...]] = []
    blocks = []
    for b, chunk in enumerate(chunks):
        block_io = [seen.io[order[p]] for p in chunk]
        produced = [o for entry in block_io for o in entry.outputs]
        produced_set = set(produced)
        inputs = {}  # an ordered set
        for entry in block_io:
            for name in entry.reads:
                if name not in produced_set and name not in initializers:
                    inputs[name] = None
        outs = [o for o in produced if o in output_set or live.last_block[o] > b]
        arena_outputs.append(tuple(outs))
        blocks.append(
            Block(
                index=b,
                node_indices=tuple(order[p] for p in chunk),
                inputs=tuple(inputs),
                outputs=tuple(dict.fromkeys(whole_of.get(o, o) for o in outs)),  # what the session writes
                workspace_bytes=_workspace_bytes(block_io, set(outs), infos),
            )
        )
    return _BlockLayout(tuple(blocks), tuple(arena_outputs))


def _block_steps(layout: _BlockLayout, chunks: Sequence[tuple[int, ...]], live: _BlockLiveness,
                 graph_inputs: Sequence[str], data_inputs: Sequence[str], output_set: set[str],
                 persistent: set[str], swap_points, io: Sequence[NodeIO]) -> list[Step]:
    """Loads of the batch, then per block its swaps and its run, freeing what it read last
    (inputs no block reads are freed with the first block)."""
    steps: list[Step] = [Load(n) for n in graph_inputs if n in set(data_inputs)]
    dead_after_load = [
        n for n in graph_inputs
        if live.last_block[n] == INPUT_POSITION and n not in output_set and n not in persistent
    ]
    frees_by_block: dict[int, list[str]] = {}
    for name, b in live.last_block.items():
        resident = live.producer_block[name] < b  # crossed a block boundary, so it lives in the arena
        if b >= 0 and resident and name not in output_set and name not in persistent:
            frees_by_block.setdefault(b, []).append(name)
    swaps_at = dict(swap_points.before) if swap_points else {}
    first_run = True
    rank = _stable_order(graph_inputs, io)
    for block, chunk in zip(layout.blocks, chunks):
        steps.extend(swaps_at.get(chunk[0], ()))
        frees = tuple(sorted(frees_by_block.get(block.index, []), key=rank))
        if first_run:
            frees = tuple(dead_after_load) + frees
            first_run = False
        steps.append(RunBlock(block.index, layout.allocates[block.index], frees))
    return steps


def _end_steps(swap_points, end: int, fetches: Sequence[str], state_pairs: Mapping[str, str]) -> list[Step]:
    """Fetches and the swaps after the last node (``end``, a schedule position).

    Swap-ins serve the fetches, swap-outs move the final state. Resident outputs are fetched
    first (each fetch frees its bytes), then the swaps run in the plan's order with each output
    fetched as soon as it is back: never more bytes at once than the order the plan was checked
    in (outputs swapped out and back, e.g. the gradients of a graph without an optimizer, arrive
    one at a time)."""
    at_end = dict(swap_points.before).get(end, ()) if swap_points else ()
    brought_back = {s.name for s in at_end if isinstance(s, SwapIn)}
    fetch_set = set(fetches)
    steps: list[Step] = [Fetch(n, free=n not in state_pairs.values()) for n in fetches if n not in brought_back]
    for swap in at_end:
        steps.append(swap)
        if isinstance(swap, SwapIn) and swap.name in fetch_set:
            steps.append(Fetch(swap.name, free=swap.name not in state_pairs.values()))
    return steps


def _check_state_updates(renames: Sequence[tuple[str, str]], infos: Mapping[str, TensorInfo]) -> None:
    """Each updated state must have its input's dtype and shape (the commit renames in place)."""
    for out, inp in renames:
        if infos[out].dtype != infos[inp].dtype or infos[out].shape != infos[inp].shape:
            raise UnsupportedGraphError(
                f"state {inp!r} is {infos[inp]} but its update {out!r} is {infos[out]}: "
                "a training step must keep each state tensor's dtype and shape"
            )


def split_views(model: onnx.ModelProto, infos: Mapping[str, TensorInfo], order: Sequence[int],
                alignment: int = DEFAULT_ALIGNMENT) -> dict[int, tuple[str, tuple[str, ...]]]:
    """The split pass's ``Split`` nodes the lowering turns into views: node index -> (whole
    value, pieces). A view needs the split axis contiguous (only size-1 dims before it), every
    piece boundary on ``alignment``, the whole value produced by a node of ``order`` and read by
    nothing but the Split, and every piece read by a later node and not a graph output."""
    nodes = list(model.graph.node)
    candidates = [i for i in order if nodes[i].op_type == "Split" and nodes[i].domain in ("", "ai.onnx")
                  and any(p.key == PASS_KEY and p.value == SPLIT_PASS for p in nodes[i].metadata_props)]
    if not candidates:
        return {}
    outputs = {o.name for o in model.graph.output}
    readers: dict[str, int] = {}
    produced: set[str] = set()
    for index in order:
        for name in consumed_names(nodes[index]):
            readers[name] = readers.get(name, 0) + 1
        produced.update(o for o in nodes[index].output if o)
    views = {}
    for index in candidates:
        node = nodes[index]
        whole, pieces = node.input[0], tuple(node.output)
        if whole not in produced or whole in outputs or readers.get(whole) != 1 or whole not in infos:
            continue
        if any(not p or p in outputs or not readers.get(p) or p not in infos or not infos[p].nbytes for p in pieces):
            continue
        shape = infos[whole].shape
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % max(len(shape), 1)
        if any(d != 1 for d in shape[:axis]):
            continue
        if any(infos[p].nbytes % alignment for p in pieces[:-1]):
            continue
        if sum(infos[p].nbytes for p in pieces) != infos[whole].nbytes:
            continue
        views[index] = (whole, pieces)
    return views


def _view_only(model: onnx.ModelProto, views) -> set[int]:
    """The view Splits and the nodes only they read (their piece-size constants): no block runs them."""
    skipped = set(views)
    if not views:
        return skipped
    readers: dict[str, set[int]] = {}
    for k, node in enumerate(model.graph.node):
        for name in consumed_names(node):
            readers.setdefault(name, set()).add(k)
    outputs = {o.name for o in model.graph.output}
    wholes = {whole for whole, _ in views.values()}
    for k, node in enumerate(model.graph.node):
        names = [o for o in node.output if o]
        if names and all(o not in wholes and o not in outputs and readers.get(o) and readers[o] <= set(views)
                         for o in names):
            skipped.add(k)
    return skipped


def _view_surrogate(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], views):
    """Nodes (same indices) where each view Split is empty and its input's producer writes the
    pieces instead, and a graph of them (inputs and outputs kept) for liveness."""
    nodes = list(nodes)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    for index, (whole, pieces) in views.items():
        k = producer[whole]
        node = onnx.NodeProto()
        node.op_type, node.name, node.domain = nodes[k].op_type, nodes[k].name, nodes[k].domain
        node.input.extend(nodes[k].input)
        node.attribute.extend(nodes[k].attribute)  # subgraph captures count as reads
        for name in nodes[k].output:
            node.output.extend(pieces if name == whole else [name])
        nodes[k] = node
        nodes[index] = onnx.NodeProto(op_type="Split", name=nodes[index].name)
    initializers = {t.name for t in graph.initializer}
    surrogate = onnx.GraphProto(name=graph.name)
    surrogate.input.extend(v for v in graph.input if v.name not in initializers)
    surrogate.output.extend(graph.output)
    surrogate.node.extend(nodes)
    return list(surrogate.node), surrogate


def _stable_order(graph_inputs: Sequence[str], io: Sequence[NodeIO]):
    rank = {n: i for i, n in enumerate(graph_inputs)}
    for entry in io:
        for out in entry.outputs:
            rank.setdefault(out, len(rank))
    return lambda name: rank.get(name, len(rank))


def nodes_workspace_bytes(block_nodes: Sequence[onnx.NodeProto], outputs: set[str], infos: Mapping[str, TensorInfo]) -> int:
    """Peak bytes of values born and dead inside the block, walking its nodes in order."""
    return _workspace_bytes(node_io(block_nodes), outputs, infos)


def _workspace_bytes(io: Sequence[NodeIO], outputs: set[str], infos: Mapping[str, TensorInfo]) -> int:
    """:func:`nodes_workspace_bytes` from the nodes' :func:`~graph_passes.ir.liveness.node_io`."""
    last_use: dict[str, int] = {}
    for i, entry in enumerate(io):
        for name in entry.reads:
            last_use[name] = i
    live = 0
    peak = 0
    dying: dict[int, int] = {}
    for i, entry in enumerate(io):
        for name in entry.outputs:
            if name not in outputs:
                size = infos[name].nbytes if name in infos else 0
                live += size
                dying[max(i, last_use.get(name, i))] = dying.get(max(i, last_use.get(name, i)), 0) + size
        peak = max(peak, live)
        live -= dying.pop(i, 0)
    return peak
