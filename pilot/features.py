"""Pilot input features: block profiles, the AFM, its fixed-size summary, the network-type
one-hot and the model's own embedding of the sample (DyNN-Offload §IV-A, §IV-C).

Owns :class:`BlockGraph` (what a caller hands in per block: its forward ONNX graph), :class:`
BlockProfile` (per-block op signatures and byte counts), :func:`profile_block`,
:func:`architecture_feature_matrix`, :func:`afm_summary`, :func:`network_type_one_hot`,
:func:`sample_features` and :func:`feature_vector`. This package never imports ``ort_offload``:
the caller exports the block graphs (``ort_offload.dynamic.pilot_support``) and passes them in.

AFM. One row per op of every block, blocks in ``model.blocks()`` order (so every branch of the
Python control flow is present, as in the paper), each row the op's 9-element signature
(:func:`pilot.idioms.op_signature`). All-zero rows mark control points: one before the first
block (where the forward dispatches on the sample) and one after every block (where it decides
what runs next: exit, loop, which branch). A block's rows are the ops of its *forward* graph,
the part that runs before the backward and so the part whose order the pilot predicts.

Summary (what the MLP takes). The AFM's row count varies between models, a fixed-size MLP
needs a fixed vector. The pilot's output is in *block units* (:mod:`pilot.encoding` divides each
column by the architecture's mean block vector), so what the MLP needs from the architecture is
what kinds of blocks there are and how many, not the op order inside a block. The summary is
``log1p`` of: the mean and the max of the per-block 10-vectors (ops, six idiom sums, three dim
sums), the number of blocks, of distinct block structures, of control rows and of AFM rows, and
the migration half over the largest block footprint (25 numbers; the last is the device, which
the execution blocks depend on). ``log1p`` keeps tiny and large configs in one numeric range.

Sample features. The model's own embedding module (``tok_emb`` / ``embedding``, else its first
``nn.Embedding``) embeds the ids; the pooling keeps what the zoo's paths depend on:

- the sequence length (``log1p(S)`` and ``S / POSITION_SLOTS``): var-LSTM's path is its length;
  Tree-LSTM's path length grows with it;
- sum pooling (not mean) of the embedded tokens through a fixed seeded projection to
  ``SUM_POOL_DIMS`` dims: a sum is linear in the token counts, so "how many segment markers"
  (var-BERT) or "which domain token is most frequent" (MoE) stays readable;
- the multiplicities of identical embedding rows, largest first, over ``S``: a count of
  repeats that does not depend on what the repeated token is;
- repeat pooling, ``sum_t count_t**2 * e_t / S**2`` over distinct rows ``t``, projected to
  ``REPEAT_POOL_DIMS``: a mean that weighs a token by how often it repeats, so the repeated
  token (MoE's domain token, var-BERT's marker) dominates the words around it;
- a hashed count of identical embedding rows: each distinct row of the embedded sample goes to
  bucket ``crc32(row bytes) % HASH_BUCKETS`` and the buckets count positions. A given token
  always lands in the same bucket, so "how many times does the marker / a domain token occur"
  is one input (plus collisions), readable by a linear layer; a sum-pooled vector mixes it with
  every other token. This is a hashed bag of tokens, seen through the embedding;
- the first ``POSITION_SLOTS`` positions, each projected to one number: order, which a pooled
  vector loses and a tree's bracket structure needs;
- for the same positions, how far back the same embedding row last occurred (``(i - j) /
  POSITION_SLOTS`` for the previous occurrence ``j``, 0 at a first occurrence): where the
  repeated tokens sit and how they alternate, without knowing which token repeats. A projected
  scalar alone cannot tell a bracket from a word whose random embedding projects to a similar
  value; a repeat offset can (Tree-LSTM exact-path accuracy 0.27 -> 0.47-0.50 in the committed
  pilots; its path length was already right, the tree shape was what it missed).

Honest limits: the projection and the per-position scalars are model-specific (they go through
the model's own random embedding table), so what the MLP learns about *which* token marks a
segment does not transfer to a family it never saw; length and repeat counts do. Rows of a
batch share one path, so per-row features are averaged over the batch.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch import nn

from pilot.idioms import SIGNATURE_SIZE, op_signature

__all__ = [
    "AFM_SUMMARY_SIZE",
    "BLOCK_VECTOR_SIZE",
    "NETWORK_TYPES",
    "POSITION_SLOTS",
    "SAMPLE_FEATURE_SIZE",
    "SUM_POOL_DIMS",
    "TOP_MULTIPLICITIES",
    "BlockGraph",
    "BlockProfile",
    "afm_summary",
    "architecture_feature_matrix",
    "embedding_module",
    "feature_size",
    "feature_vector",
    "network_type_one_hot",
    "profile_block",
    "sample_features",
]

NETWORK_TYPES = ("cnn", "lstm", "transformer")
"""One MLP per network type, in this order (the one-hot's order)."""
BLOCK_VECTOR_SIZE = 1 + SIGNATURE_SIZE
"""Per-block vector: op count, then the column sums of its signatures (6 idioms, 3 dims)."""
AFM_SUMMARY_SIZE = 2 * BLOCK_VECTOR_SIZE + 5
SUM_POOL_DIMS = 16
REPEAT_POOL_DIMS = 8
TOP_MULTIPLICITIES = 4
HASH_BUCKETS = 64
POSITION_SLOTS = 24
SAMPLE_FEATURE_SIZE = 2 + SUM_POOL_DIMS + REPEAT_POOL_DIMS + TOP_MULTIPLICITIES + HASH_BUCKETS + 2 * POSITION_SLOTS
PROJECTION_SEED = 20240607
"""Seed of the fixed random projections of the embedding (part of the feature definition)."""

_ELEMENT_BYTES = {
    onnx.TensorProto.FLOAT: 4, onnx.TensorProto.DOUBLE: 8, onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2, onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT8: 1, onnx.TensorProto.UINT8: 1, onnx.TensorProto.BOOL: 1,
}


@dataclass(frozen=True)
class BlockGraph:
    """A block's forward graph as the caller exported it, with what the profile needs.

    ``forward``: ONNX model of the block's forward part (``ort_offload.dynamic.block_export.split_step``);
    ``saved``: names of its outputs that are saved activations (kept for the backward);
    ``param_bytes``: bytes of the block's parameters and buffers."""

    forward: onnx.ModelProto
    saved: tuple[str, ...]
    param_bytes: int


@dataclass(frozen=True)
class BlockProfile:
    """Static description of one block: op types and signatures in graph order, the summed
    10-vector, bytes of parameters and of saved activations per invocation, a structure key
    (equal for blocks with the same op rows)."""

    op_types: tuple[str, ...]
    rows: np.ndarray  # [ops, SIGNATURE_SIZE]
    vector: np.ndarray  # [BLOCK_VECTOR_SIZE]
    param_bytes: int
    saved_bytes: int
    structure: str


def _shape_table(model: onnx.ModelProto) -> dict[str, tuple[tuple[int | None, ...], int]]:
    """name -> (shape, element type) for every typed value of the graph."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph shape inference cannot handle keeps its own value_info
        pass
    graph = model.graph
    table: dict[str, tuple[tuple[int | None, ...], int]] = {}
    for init in graph.initializer:
        table[init.name] = (tuple(int(d) for d in init.dims), init.data_type)
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
        table[value.name] = (dims, tensor.elem_type)
    return table


def profile_block(graph: BlockGraph) -> BlockProfile:
    """Op signatures of ``graph.forward`` in node order, and its byte counts."""
    shapes = _shape_table(graph.forward)
    op_types: list[str] = []
    rows: list[np.ndarray] = []
    for node in graph.forward.graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.type == onnx.AttributeProto.INT}
        input_shapes = [shapes.get(name, (None, 0))[0] if name else None for name in node.input]
        rows.append(op_signature(node.op_type, input_shapes, attributes))
        op_types.append(node.op_type)
    matrix = np.stack(rows) if rows else np.zeros((0, SIGNATURE_SIZE))
    saved_bytes = 0
    for name in graph.saved:
        dims, elem = shapes.get(name, ((), onnx.TensorProto.FLOAT))
        saved_bytes += int(np.prod([d or 0 for d in dims])) * _ELEMENT_BYTES.get(elem, 4)
    vector = np.concatenate([[len(op_types)], matrix.sum(axis=0)])
    structure = hashlib.sha1(matrix.tobytes() + "|".join(op_types).encode()).hexdigest()[:16]
    return BlockProfile(tuple(op_types), matrix, vector, int(graph.param_bytes), saved_bytes, structure)


def architecture_feature_matrix(profiles: Sequence[BlockProfile]) -> np.ndarray:
    """The AFM: a zero control row, then each block's op rows followed by a zero control row."""
    control = np.zeros((1, SIGNATURE_SIZE))
    parts = [control]
    for profile in profiles:
        parts.extend([profile.rows, control])
    return np.concatenate(parts, axis=0)


def afm_summary(profiles: Sequence[BlockProfile], migration_half_bytes: int) -> np.ndarray:
    """Fixed-size (:data:`AFM_SUMMARY_SIZE`) summary of the AFM (see the module docstring),
    plus the device: the migration half in units of the largest block footprint (execution
    blocks depend on it)."""
    if not profiles:
        raise ValueError("an architecture needs at least one block")
    vectors = np.stack([p.vector for p in profiles])
    afm = architecture_feature_matrix(profiles)
    control_rows = int((~afm.any(axis=1)).sum())
    largest = max(max(p.param_bytes + p.saved_bytes for p in profiles), 1)
    counts = [len(profiles), len({p.structure for p in profiles}), control_rows, afm.shape[0],
              migration_half_bytes / largest]
    return np.log1p(np.concatenate([vectors.mean(axis=0), vectors.max(axis=0), counts]))


def network_type_one_hot(network_type: str) -> np.ndarray:
    """One-hot over :data:`NETWORK_TYPES`; ``ValueError`` for another type."""
    if network_type not in NETWORK_TYPES:
        raise ValueError(f"network type must be one of {', '.join(NETWORK_TYPES)}, got {network_type!r}")
    one_hot = np.zeros(len(NETWORK_TYPES))
    one_hot[NETWORK_TYPES.index(network_type)] = 1.0
    return one_hot


def embedding_module(model: nn.Module) -> nn.Embedding:
    """The model's token embedding: ``tok_emb`` or ``embedding`` if it is an ``nn.Embedding``,
    else the first ``nn.Embedding`` among its modules."""
    for name in ("tok_emb", "embedding"):
        module = getattr(model, name, None)
        if isinstance(module, nn.Embedding):
            return module
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module
    raise ValueError(f"{type(model).__name__} has no nn.Embedding: the pilot needs the model's own embedding")


_PROJECTIONS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _projections(dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fixed seeded projections of a ``dim``-wide embedding: ``[dim, SUM_POOL_DIMS]``,
    ``[dim, REPEAT_POOL_DIMS]`` and ``[dim]`` (the per-position scalar), scaled by ``1 / sqrt(dim)``."""
    if dim not in _PROJECTIONS:
        generator = torch.Generator().manual_seed(PROJECTION_SEED + dim)
        pool = torch.randn(dim, SUM_POOL_DIMS, generator=generator) / dim**0.5
        repeat = torch.randn(dim, REPEAT_POOL_DIMS, generator=generator) / dim**0.5
        position = torch.randn(dim, generator=generator) / dim**0.5
        _PROJECTIONS[dim] = (pool.numpy(), repeat.numpy(), position.numpy())
    return _PROJECTIONS[dim]


def sample_features(model: nn.Module, ids: torch.Tensor, *, embedding: nn.Embedding | None = None) -> np.ndarray:
    """Features (:data:`SAMPLE_FEATURE_SIZE`) of a batch ``ids[B, S]`` from the model's own
    embedding (see the module docstring), averaged over the batch's rows. ``embedding``: the
    embedding to use instead of the model's live one (the pilot passes the snapshot it took at
    attach time)."""
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be [B, S >= 1], got {tuple(ids.shape)}")
    embedding = embedding if embedding is not None else embedding_module(model)
    with torch.no_grad():
        embedded = embedding(ids).float().numpy()  # [B, S, D]
    batch, seq, dim = embedded.shape
    pool, repeat, position = _projections(dim)
    summed = (embedded.sum(axis=1) @ pool).mean(axis=0)
    scalars = (embedded[:, :POSITION_SLOTS] @ position).mean(axis=0)
    multiplicities = np.zeros(TOP_MULTIPLICITIES)
    repeated = np.zeros(REPEAT_POOL_DIMS)
    buckets = np.zeros(HASH_BUCKETS)
    offsets = np.zeros(POSITION_SLOTS)
    for row in embedded:
        rows, inverse, counts = np.unique(row, axis=0, return_inverse=True, return_counts=True)
        last: dict[int, int] = {}
        for i, token in enumerate(inverse.reshape(-1)[:POSITION_SLOTS].tolist()):
            offsets[i] += (i - last.get(token, i)) / POSITION_SLOTS
            last[token] = i
        top = np.sort(counts)[::-1][:TOP_MULTIPLICITIES]
        multiplicities[: len(top)] += top / seq
        repeated += (counts.astype(np.float64) ** 2 @ rows) @ repeat / seq**2
        for distinct, count in zip(rows, counts):
            buckets[zlib.crc32(distinct.tobytes()) % HASH_BUCKETS] += count
    positions = np.zeros(POSITION_SLOTS)
    positions[: scalars.shape[0]] = scalars
    return np.concatenate([[np.log1p(seq), seq / POSITION_SLOTS], summed, repeated / batch,
                           multiplicities / batch, buckets / batch, positions, offsets / batch])


def feature_size() -> int:
    """Width of :func:`feature_vector`."""
    return AFM_SUMMARY_SIZE + len(NETWORK_TYPES) + SAMPLE_FEATURE_SIZE


def feature_vector(summary: np.ndarray, one_hot: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """The pilot's input: AFM summary, network-type one-hot, sample features (float32)."""
    return np.concatenate([summary, one_hot, sample]).astype(np.float32)
