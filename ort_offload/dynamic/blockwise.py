"""Block-wise training of dynamic networks (docs/design.md, "Dynamic networks (DyNN-Offload)").

Owns the ONNX Runtime sessions of a block step's forward and backward parts (:class:`CompiledStep`;
the step's export and split are :mod:`ort_offload.dynamic.block_export`), the cache of compiled
steps (:class:`BlockStepCache`), the ``torch.autograd.Function`` that chains the parts through
torch autograd, the wrapping of a
model's blocks (:func:`wrap_blocks` / :func:`unwrap_blocks`) and the unbudgeted executor
(:class:`HostExecutor`). The trainer is :mod:`ort_offload.dynamic.trainer`; the budgeted executor
:mod:`ort_offload.dynamic.runtime`.

How values flow. A wrapped block's forward calls the autograd Function with the block's
arguments, then its parameters and buffers, as the Function's inputs. The Function's forward
runs the forward part in ONNX Runtime and returns ``y`` as torch tensors; the backward part's
saved activations stay with that invocation's autograd node (numpy arrays owned by ``ctx``), so
a block called many times in one forward (an LSTM step) keeps one set per call. Its backward
runs the backward part with ``dy`` and returns ``dx`` and ``dparam`` as the gradients of the
Function's inputs, so torch autograd itself accumulates ``dparam`` into ``param.grad`` (summed
over every invocation of the block) and carries ``dx`` on through the model's own Python code.

Randomness. The step is traced in the block's current mode. A block that draws random numbers
(Dropout with ``p > 0`` in training mode) gets them from ONNX Runtime's random ops, seeded per
node: forward and backward of one invocation share the mask (it is a saved activation), but the
draws differ from torch's. Gradient-equivalence with torch needs dropout off (the zoo's tiny
configs have ``dropout = 0``). Buffer mutations inside a block (BatchNorm running statistics in
training mode) are not carried back to the module.

Caching. A step is keyed by the block's structure (class code, ``repr``, parameter and buffer
names/shapes/dtypes, training mode) and its input signature (dtype and shape of every
argument), not by the block's identity: blocks of the same structure (the layers of an encoder)
share one export and one pair of sessions, since parameters are inputs of the graph. Exported
graphs are also cached on disk next to the whole-step exports (:func:`ort_offload.export.training_step.
default_cache_dir`), so a later process skips torch entirely.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from typing import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ort_offload.dynamic.block_export import (
    SplitStep,
    VJPStep,
    _check_args,
    _signature_of,
    block_cache_key,
    export_block_step,
    split_step,
)
from ort_offload.runtime.block_session import default_session_options
from ort_offload.errors import InputMismatchError, UnsupportedGraphError
from ort_offload.export.training_step import _structure_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "BlockStepCache",
    "HostExecutor",
    "CompiledStep",
    "SplitStep",
    "VJPStep",
    "default_blocks",
    "export_block_step",
    "split_step",
    "unwrap_blocks",
    "wrap_blocks",
]


# --------------------------------------------------------------------------------------------
# Sessions and the autograd Function
# --------------------------------------------------------------------------------------------


def _session(model: onnx.ModelProto, what: str) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(model.SerializeToString(), sess_options=default_session_options(),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        raise UnsupportedGraphError(f"ONNX Runtime cannot run the {what} ({str(e).splitlines()[0]})") from e


class CompiledStep:
    """A block step's two parts as ONNX Runtime sessions (CPU EP, :func:`default_session_options`)."""

    def __init__(self, step: VJPStep) -> None:
        self.step = step
        self.split = split_step(step)
        name = step.model.graph.name
        self.forward_session = _session(self.split.forward, f"forward part of {name}")
        self.backward_session = _session(self.split.backward, f"backward part of {name}")
        self.n_args = len(step.arg_inputs)
        self.state_inputs = step.arg_inputs + step.param_inputs + step.buffer_inputs  # Function input order
        position = {n: i for i, n in enumerate(self.state_inputs)}
        self.forward_positions = [position[n] for n in self.split.forward_inputs]
        self.backward_positions = [position[n] for n in self.split.backward_state_inputs]
        self.forward_outputs = [o.name for o in self.split.forward.graph.output]  # y, then saved not in y
        self.backward_outputs = list(step.dx_outputs) + list(step.grad_outputs)
        # Where each backward output goes among the Function's inputs.
        self.grad_positions = list(step.dx_args) + [self.n_args + i for i in step.grad_params]

    def run_forward(self, values: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        feeds = {n: values[i] for n, i in zip(self.split.forward_inputs, self.forward_positions)}
        out = dict(zip(self.forward_outputs, self.forward_session.run(self.forward_outputs, feeds)))
        return [out[n] for n in self.step.y_outputs], [out[n] for n in self.split.saved]

    def run_backward(self, dys: Sequence[np.ndarray], saved: Sequence[np.ndarray],
                     state: Sequence[np.ndarray]) -> list[np.ndarray]:
        feeds = dict(zip(self.step.dy_inputs, dys))
        feeds.update(zip(self.split.saved, saved))
        feeds.update(zip(self.split.backward_state_inputs, state))
        return self.backward_session.run(self.backward_outputs, feeds)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


class HostExecutor:
    """Runs block parts on host arrays with no budget: the arguments and parameters are fed to
    ONNX Runtime as they are and the saved activations stay with the invocation (numpy arrays).

    An executor gives a block invocation its meaning. ``forward(compiled, block_id, inputs)``
    returns ``(ys, handle, to_save)``: the outputs as torch tensors, what the backward needs
    (opaque to the caller) and the torch inputs to keep with ``save_for_backward`` (torch then
    checks they were not modified in place before the backward). ``backward(compiled, handle,
    dys, saved_tensors)`` returns the backward part's outputs (``dx`` then ``grad``) as numpy
    arrays. The budgeted executor is :class:`ort_offload.dynamic.runtime.BlockRuntime`.
    """

    def forward(self, compiled: "CompiledStep", block_id: int, inputs: Sequence[torch.Tensor]):
        ys, saved = compiled.run_forward([_to_numpy(t) for t in inputs])
        to_save = [inputs[i] for i in compiled.backward_positions]
        return [torch.from_numpy(y) for y in ys], saved, to_save

    def backward(self, compiled: "CompiledStep", handle, dys: Sequence[torch.Tensor],
                 saved_tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        state = [_to_numpy(t) for t in saved_tensors]
        return compiled.run_backward([_to_numpy(d) for d in dys], handle, state)


class _BlockFunction(torch.autograd.Function):
    """``apply(executor, compiled, block_id, *args, *params, *buffers) -> y tuple``; backward
    gives dx and dparams.

    Parameters are inputs of the Function, so autograd accumulates ``dparam`` into ``.grad``.
    What the backward part needs is the executor's ``handle`` (one per invocation, so a block
    called many times in one forward keeps one set of saved activations per call).
    """

    @staticmethod
    def forward(ctx, executor, compiled: CompiledStep, block_id: int, *inputs):
        ys, handle, to_save = executor.forward(compiled, block_id, inputs)
        ctx.executor = executor
        ctx.compiled = compiled
        ctx.handle = handle
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(*to_save)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        compiled: CompiledStep = ctx.compiled
        grads = ctx.executor.backward(compiled, ctx.handle, dys, ctx.saved_tensors)
        ctx.handle = None  # activations are dead once their backward ran
        result: list[torch.Tensor | None] = [None] * ctx.n_inputs
        for position, grad in zip(compiled.grad_positions, grads):
            result[position] = torch.from_numpy(grad)
        return (None, None, None, *result)


# --------------------------------------------------------------------------------------------
# Cache and wrapping
# --------------------------------------------------------------------------------------------


class BlockStepCache:
    """Compiled steps by (block structure, input signature), with counters.

    ``exports``: steps traced by torch; ``disk_hits``: steps loaded from the disk cache;
    ``memory_hits``: calls served by an already compiled step; ``export_times_s``: seconds per
    compiled step (trace + ONNX export, or disk load).
    """

    def __init__(self, *, cache_dir: str | os.PathLike | None = None, use_disk: bool = True) -> None:
        self.cache_dir = cache_dir
        self.use_disk = use_disk
        self.steps: dict[str, CompiledStep] = {}
        self.exports = 0
        self.disk_hits = 0
        self.memory_hits = 0
        self.export_times_s: list[float] = []
        # Structure hash per live block and training mode (weak: a freed block's id may be reused).
        self._structure: weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, str]] = weakref.WeakKeyDictionary()

    @property
    def compiled(self) -> int:
        """Steps compiled so far (exported or loaded from disk)."""
        return len(self.steps)

    def get(self, block: torch.nn.Module, args: Sequence[torch.Tensor]) -> CompiledStep:
        per_mode = self._structure.setdefault(block, {})
        struct = per_mode.get(block.training)
        if struct is None:
            struct = hashlib.sha256(
                json.dumps(_structure_fingerprint(block, None), sort_keys=True, default=str).encode()
            ).hexdigest()
            per_mode[block.training] = struct
        key = hashlib.sha256(json.dumps([struct, _signature_of(args)]).encode()).hexdigest()[:24]
        compiled = self.steps.get(key)
        if compiled is not None:
            self.memory_hits += 1
            return compiled
        step = export_block_step(block, args, cache_dir=self.cache_dir, use_cache=self.use_disk,
                                 key=block_cache_key(block, args))
        if step.cache_hit:
            self.disk_hits += 1
        else:
            self.exports += 1
        self.export_times_s.append(step.export_time_s)
        compiled = CompiledStep(step)
        self.steps[key] = compiled
        return compiled


_WRAPPED_ATTR = "_ort_blockwise_cache"


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.blocks()`` when the model has it, else the children of every ``nn.ModuleList``
    (containers themselves excluded; a block inside another block is left to its outer block)."""
    blocks_fn = getattr(model, "blocks", None)
    if callable(blocks_fn):
        return list(blocks_fn())
    candidates = [
        child
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        for child in module.children()
        if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict))
    ]
    inner = {id(m) for c in candidates for m in c.modules() if m is not c}
    return [c for c in candidates if id(c) not in inner]


def wrap_blocks(
    model: torch.nn.Module,
    blocks: Sequence[torch.nn.Module] | None = None,
    *,
    cache: BlockStepCache | None = None,
    cache_dir: str | os.PathLike | None = None,
    executor=None,
) -> BlockStepCache:
    """Make each block's forward run its step's forward part in ONNX Runtime, its backward the
    backward part; the model's own forward (Python control flow) runs unchanged.

    ``blocks`` defaults to :func:`default_blocks`; a block's id is its position in that list
    (the index ``model.path`` uses). ``executor`` runs the parts (default :class:`HostExecutor`:
    host arrays, no budget). Returns the :class:`BlockStepCache` the blocks share (``cache``
    when given). :func:`unwrap_blocks` restores the original forwards.
    """
    blocks = default_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise InputMismatchError(f"{type(model).__name__} has no blocks to wrap (no blocks() and no nn.ModuleList)")
    cache = cache if cache is not None else BlockStepCache(cache_dir=cache_dir)
    executor = executor if executor is not None else HostExecutor()
    seen: set[int] = set()
    for block_id, block in enumerate(blocks):
        if not isinstance(block, torch.nn.Module):
            raise InputMismatchError(f"blocks must be nn.Modules, got a {type(block).__name__}")
        if id(block) in seen:
            continue
        seen.add(id(block))
        if hasattr(block, _WRAPPED_ATTR):
            raise InputMismatchError(f"{type(block).__name__} is already wrapped; unwrap_blocks first")
        block.__dict__["forward"] = _make_forward(block, block_id, cache, executor)
        object.__setattr__(block, _WRAPPED_ATTR, cache)
    model.__dict__["_ort_blockwise_blocks"] = [b for b in blocks]
    return cache


def unwrap_blocks(model: torch.nn.Module) -> None:
    """Restore the original forward of every block :func:`wrap_blocks` wrapped in ``model``."""
    for block in model.__dict__.pop("_ort_blockwise_blocks", []):
        block.__dict__.pop("forward", None)
        block.__dict__.pop(_WRAPPED_ATTR, None)


def _make_forward(block: torch.nn.Module, block_id: int, cache: BlockStepCache, executor) -> Callable:
    def forward(*args, **kwargs):
        _check_args(args, kwargs, type(block).__name__)
        compiled = cache.get(block, args)
        params = [p for _, p in block.named_parameters()]
        buffers = [b for _, b in block.named_buffers()]
        ys = _BlockFunction.apply(executor, compiled, block_id, *args, *params, *buffers)
        return tuple(ys) if compiled.step.tuple_output else ys[0]

    return forward
