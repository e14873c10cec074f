"""Sharded optimizer state (ZeRO stage 1-2): which rank owns which parameters, and each rank's step graph.

The updated parameters are cut, in graph order, into one contiguous group per rank of about
equal bytes. A rank's step graph is the whole training step — forward and backward make every
gradient, since every rank's gradient of every parameter goes into the sum — with the state
updates of its own parameters only: the other parameters' update nodes and optimizer moments
are gone, so the rank's planner and arena see 1/N of the moments. Each gradient the rank does
not update with is read once more, by a ``Size`` node placed first after the backward, so it
stays in the arena until the gradients are reduced and is freed right after (it is sent to its
owner there: :mod:`ort_offload.distributed`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import onnx

from graph_passes.ir.liveness import ancestor_nodes, node_io
from graph_passes.ir.training_graph import Role, TrainingGraph

# Prefix of the nodes that keep another rank's gradients alive until the reduction.
RELEASE_PREFIX = "sharding/release/"


@dataclasses.dataclass(frozen=True)
class Shards:
    """Which rank owns each updated parameter (keeps its optimizer moments and updates it)."""

    world_size: int
    owner: Mapping[str, int]  # updated parameter -> rank
    moments: Mapping[str, tuple[str, ...]]  # updated parameter -> its optimizer state inputs
    grad_owner: Mapping[str, int]  # gradient -> the rank that updates with it

    def owned(self, rank: int) -> list[str]:
        """The parameters ``rank`` updates, in graph order."""
        return [p for p, r in self.owner.items() if r == rank]

    def sharded_state(self) -> dict[str, int]:
        """Each optimizer state input that only its owner holds -> that owner."""
        return {m: self.owner[p] for p, names in self.moments.items() for m in names}


def partition_parameters(graph: TrainingGraph, nbytes: Mapping[str, int], world_size: int) -> Shards:
    """Owners for ``graph``'s updated parameters: contiguous groups of about equal bytes
    (``nbytes``: bytes of each state input), rank 0 first, in graph order."""
    params = [n for n in graph.state_inputs if graph.roles.get(n) == Role.PARAM and n in graph.state_pairs]
    total = max(sum(nbytes[p] for p in params), 1)
    owner, done = {}, 0
    for name in params:  # the rank whose share holds the parameter's middle byte
        owner[name] = min(world_size - 1, (2 * done + nbytes[name]) * world_size // (2 * total))
        done += nbytes[name]
    optimizer_state = [n for n in graph.state_inputs if graph.roles.get(n) == Role.OPTIMIZER_STATE
                       and n in graph.state_pairs]
    moments = {p: tuple(m for m in optimizer_state if _belongs(m, p, params)) for p in params}
    return Shards(world_size, owner, moments, _gradient_owners(graph, owner, moments))


def _belongs(state: str, param: str, params: Sequence[str]) -> bool:
    """Whether optimizer state input ``state`` is ``param``'s (``<param>.<moment>``, the
    longest parameter name that prefixes it)."""
    if not state.startswith(param + "."):
        return False
    return not any(len(other) > len(param) and state.startswith(other + ".") for other in params)


def _gradient_owners(graph: TrainingGraph, owner: Mapping[str, int], moments: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Each gradient -> the owner of the parameter whose update reads it (found in the graph:
    the gradients the update nodes of the parameter and its moments read)."""
    nodes = list(graph.model.graph.node)
    io = node_io(nodes)
    producer = {name: index for index, entry in enumerate(io) for name in entry.outputs}
    grads = {n for n, role in graph.roles.items() if role == Role.GRAD}
    backward = ancestor_nodes(nodes, sorted(grads), producer, io)
    result: dict[str, int] = {}
    for param, rank in owner.items():
        updates = [graph.state_pairs[n] for n in (param, *moments[param])]
        for index in ancestor_nodes(nodes, updates, producer, io) - backward:
            for name in io[index].reads:
                if name in grads and result.setdefault(name, rank) != rank:
                    raise ValueError(f"gradient {name} updates parameters of two ranks")
    missing = sorted(grads - set(result))
    if missing:
        raise ValueError(f"gradient {missing[0]} updates no parameter")
    return result


def rank_graph(graph: TrainingGraph, shards: Shards, rank: int) -> TrainingGraph:
    """``graph`` as ``rank`` runs it: every gradient made, only its own parameters (and their
    moments) updated, the other moments gone, and each other gradient kept until the updates."""
    others = [p for p, r in shards.owner.items() if r != rank]
    gone_updates = {graph.state_pairs[n] for p in others for n in (p, *shards.moments[p])}
    gone_moments = {m for p in others for m in shards.moments[p]}
    outputs = [o for o in graph.model.graph.output if o.name not in gone_updates]
    released = sorted(g for g, r in shards.grad_owner.items() if r != rank)
    nodes = list(graph.model.graph.node)
    io = node_io(nodes)
    producer = {name: index for index, entry in enumerate(io) for name in entry.outputs}
    needed = sorted(ancestor_nodes(nodes, [o.name for o in outputs] + released, producer, io))
    backward = ancestor_nodes(nodes, sorted(shards.grad_owner), producer, io)
    after = max((k for k, index in enumerate(needed) if index in backward), default=-1) + 1
    release = [onnx.helper.make_node("Size", [g], [RELEASE_PREFIX + g], name=RELEASE_PREFIX + g) for g in released]
    kept = [nodes[i] for i in needed]
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    del model.graph.node[:]
    model.graph.node.extend(kept[:after] + release + kept[after:])  # still topological
    _keep_only(model.graph.input, lambda v: v.name not in gone_moments)
    _keep_only(model.graph.output, lambda v: v.name not in gone_updates)
    present = {v.name for v in model.graph.input} | {o for n in model.graph.node for o in n.output}
    _keep_only(model.graph.value_info, lambda v: v.name in present)
    roles = {n: r for n, r in graph.roles.items() if n in present}
    roles.update({RELEASE_PREFIX + g: Role.ACTIVATION for g in released})
    pairs = {s: u for s, u in graph.state_pairs.items() if u not in gone_updates}
    return TrainingGraph(model=model, roles=roles, state_pairs=pairs, name=graph.name)


def _keep_only(field, keep) -> None:
    """Drop the entries of a repeated protobuf ``field`` that ``keep`` refuses (order kept)."""
    kept = [entry for entry in field if keep(entry)]
    del field[:]
    field.extend(kept)


__all__ = ["RELEASE_PREFIX", "Shards", "partition_parameters", "rank_graph"]
