"""The budgeted runtime of block-wise training (DyNN-Offload §IV-E): block parameters and saved
activations move between a budget-capped device arena and host memory, guided by a path
prediction, with execution-block prefetch into a double-buffered arena and a tensor-fault
handler for mispredictions.

:class:`BlockRuntime` is an executor for :mod:`ort_offload.dynamic.blockwise` (it gives each block
invocation its meaning). Where tensors live:

- **Host** (the host store): the master copy of every block parameter and buffer (the torch
  tensors themselves), gradients (torch accumulates them into ``param.grad``) and optimizer
  state; the optimizer runs on the host, as ZeRO-Offload's CPU Adam does. Saved activations an
  eviction wrote back live here until their backward.
- **Device** (the arena, capped at the budget): the parameters of the blocks about to run, each
  invocation's inputs, outputs and saved activations, and the parameters of the stem and head
  (the modules outside the blocks, charged for the whole step). Each part runs in ONNX Runtime
  with its inputs and outputs bound into arena buffers; the arena is capped at the budget less
  the part's workspace (values born and dead inside it), as in the static runtime.

One step. :meth:`begin_step` asks the predictor for the batch's path grouped into execution
blocks (the ``pilot_model_inference`` step that starts every sample's program) and prefetches
execution block 0. Each block invocation then:

1. on entering execution block ``i``: evicts from the migration half what blocks ``i`` and
   ``i + 1`` do not need, as much as ``i + 1``'s prefetch needs, then issues the prefetch of
   ``i + 1``'s parameters (and, in the backward, its written-back saved activations) into the
   migration half on the host→device copy engine;
2. checks the prediction: the first invocation that differs from the predicted path (or runs
   past its end) marks the batch mispredicted, and later forward invocations get no prefetch;
3. makes its inputs resident: one in flight costs a wait (a prefetch hit); one neither resident
   nor in flight is a **tensor fault**, fetched synchronously, counted and logged;
4. runs, then hands its outputs back to torch and frees what is dead.

Where tensors are placed and how they move is :mod:`ort_offload.dynamic.residency`; this
module gives it the future. Whenever an allocation does not fit, it evicts by Belady's rule over the known future
(the rest of the predicted forward, then the backward in reverse): the tensor whose next use is
furthest goes first; a parameter is dropped (its host copy is current), a saved activation is
written back. If nothing is left to evict the invocation cannot run under the budget:
:class:`BudgetTooSmallError` names what it needs, before any parameter changed.

A mispredicted batch is written to the misprediction log (its inputs, the predicted and the
true path: training data for the pilot) and its true path goes into the misprediction cache
(:mod:`ort_offload.dynamic.misprediction_cache`), which corrects later predictions the predictor keeps
getting wrong the same way.

``residency="resident"`` turns the runtime into the no-offload baseline under the same
accounting: nothing is ever evicted and every parameter's gradient and optimizer state are
charged to the arena too, as a framework that keeps the whole model on the device would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import torch

from graph_passes.ir.program import nodes_workspace_bytes
from graph_passes.ir.shapes import TensorInfo
from ort_offload.runtime.arena import DeviceArena
from ort_offload.errors import BudgetTooSmallError, ExecutionError
from ort_offload.dynamic.misprediction_cache import MispredictionCache
from ort_offload.dynamic.residency import Residency, RuntimeStats, TraceEvent
from pilot.prediction import NoPredictor, PathPrediction, PathPredictor, even_groups

__all__ = ["BlockRuntime", "RESIDENCY_MODES", "RuntimeStats", "TraceEvent", "part_tensor_infos"]  # stats and events: re-exported

RESIDENCY_MODES = ("offload", "resident")


def part_tensor_infos(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Dtype and static shape of every declared value of a block part (inputs, outputs,
    internal values, initializers). Block steps are exported at one input signature, so every
    declared shape is concrete."""
    infos: dict[str, TensorInfo] = {}
    graph = model.graph
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        tensor_type = value.type.tensor_type
        if not tensor_type.elem_type or not tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if any(d is None for d in dims):
            continue
        infos[value.name] = TensorInfo(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)), tuple(dims))
    for tensor in graph.initializer:
        infos[tensor.name] = TensorInfo(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)), tuple(tensor.dims))
    return infos


class _BoundPart:
    """One part (forward or backward) of a compiled block step, run with its inputs and outputs
    bound to arena pointers."""

    def __init__(self, session, model: onnx.ModelProto) -> None:
        self.session = session
        self.model = model
        self.binding = session.io_binding()
        self.inputs = tuple(v.name for v in model.graph.input)
        self.outputs = tuple(v.name for v in model.graph.output)
        self.infos = part_tensor_infos(model)
        missing = [n for n in self.inputs + self.outputs if n not in self.infos]
        if missing:
            raise ExecutionError(f"block part {model.graph.name} has no static shape for {', '.join(missing)}")
        self.workspace_bytes = nodes_workspace_bytes(list(model.graph.node), set(self.outputs), self.infos)
        self._bound: dict[str, int] = {}

    def run(self, arena: DeviceArena, names: dict[str, str]) -> None:
        """Run reading each input from / writing each output to the arena tensor ``names[value]``."""
        for values, bind in ((self.inputs, self.binding.bind_input), (self.outputs, self.binding.bind_output)):
            for value in values:
                pointer = arena.pointer(names[value])
                if self._bound.get(value) != pointer:  # rebind only what moved
                    info = self.infos[value]
                    bind(value, "cpu", 0, info.dtype, list(info.shape), pointer)
                    self._bound[value] = pointer
        self.session.run_with_iobinding(self.binding)


@dataclasses.dataclass
class _Invocation:
    """One block invocation of the current step: what its backward needs and where it is."""

    index: int
    block_id: int
    compiled: Any
    kept: dict[str, str]  # backward-part input value -> arena/host tensor name (saved activations, arguments)


class BlockRuntime:
    """Executor of block invocations under a device budget (see the module docstring).

    ``blocks``: the model's blocks in id order (``model.blocks()``). ``resident_params``: the
    parameters outside the blocks (stem, head), charged to the arena for the whole step. ``budget_bytes=None``: unlimited (a growable arena). ``predictor``: who guesses
    the path (default: :class:`~pilot.prediction.NoPredictor`, every fetch a fault).
    ``misprediction_log``: a JSON-lines file that gets one record per mispredicted batch.
    """

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        *,
        budget_bytes: int | None,
        predictor: PathPredictor | None = None,
        resident_params: Sequence[torch.Tensor] = (),
        residency: str = "offload",
        arena_policy: str = "double_buffer",
        optimizer_states: int = 2,
        misprediction_cache: bool = True,
        misprediction_log: str | os.PathLike | None = None,
        prefetch: bool = True,
        pre_evict: bool = False,
        alignment: int = 64,
    ) -> None:
        if residency not in RESIDENCY_MODES:
            raise ValueError(f"unknown residency {residency!r}: use one of {', '.join(RESIDENCY_MODES)}")
        self.blocks = list(blocks)
        self.budget = budget_bytes
        self.predictor = predictor or NoPredictor()
        self.residency = residency
        self.prefetch = prefetch
        self.pre_evict = pre_evict
        self.use_misprediction_cache = misprediction_cache
        self.misprediction_cache = MispredictionCache()
        self.misprediction_log = Path(misprediction_log) if misprediction_log is not None else None
        self.stats = RuntimeStats()
        self.mem = Residency(budget_bytes=budget_bytes, arena_policy=arena_policy, alignment=alignment,
                             stats=self.stats, next_use=self._next_use, record=lambda e: self.trace.append(e),
                             keep_all=residency == "resident")
        self.min_budget_bytes = 0  # largest single-invocation need seen (resident + part in/out + workspace)
        self._parts: dict[tuple[int, str], _BoundPart] = {}
        self._block_sources: list[dict[str, torch.Tensor]] = [self._sources(b) for b in self.blocks]
        self.trace: list[TraceEvent] = []  # the current step's events, in program order
        self.step_traces: list[list[TraceEvent]] = []  # completed steps' traces (the last 16)
        self._charge_resident(resident_params, optimizer_states)
        self._reset_step()

    @property
    def arena(self) -> DeviceArena:
        return self.mem.arena

    @property
    def peak(self) -> int:
        """The most device memory any point of any step took (arena live bytes + workspace)."""
        return self.mem.peak

    # ---- setup ---------------------------------------------------------------------------

    @staticmethod
    def _sources(block: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Host tensors of a block by step-graph input name (``param.<fqn>``, ``buffer.<fqn>``)."""
        out = {f"param.{n}": p for n, p in block.named_parameters()}
        out.update({f"buffer.{n}": b for n, b in block.named_buffers()})
        return out

    def _charge_resident(self, params: Sequence[torch.Tensor], optimizer_states: int) -> None:
        """Charge the arena for what stays on the device all step: the stem and head parameters,
        and in resident mode every parameter's gradient and optimizer state."""
        charged = [(f"resident/stem+head/{i}", p.numel() * p.element_size()) for i, p in enumerate(params)]
        if self.residency == "resident":  # gradient and optimizer state of every parameter
            trained = [p for p in params if p.requires_grad] + [
                t for sources in self._block_sources for t in sources.values() if t.requires_grad]
            charged += [(f"resident/grad+state/{i}", (1 + optimizer_states) * t.numel() * t.element_size())
                        for i, t in enumerate(trained)]
        for name, nbytes in charged:
            if name in self.mem.arena:
                continue
            if self.budget is not None and self.mem.arena.in_use + nbytes > self.budget:
                total = sum(-(-n // self.mem.arena.alignment) * self.mem.arena.alignment for _, n in charged)
                raise BudgetTooSmallError(
                    f"the stem and head{' and all gradients and optimizer state' if self.residency == 'resident' else ''} "
                    f"need {total} bytes of device memory but the budget is {self.budget}; raise the budget",
                    needed_bytes=total, budget_bytes=self.budget)
            self.mem.allocate(name, TensorInfo(np.dtype(np.uint8), (nbytes,)), protect=set(), what="the resident stem/head/state")
        self.resident_bytes = self.mem.arena.in_use
        self.mem.measure(0)

    def _part(self, compiled, which: str) -> _BoundPart:
        key = (id(compiled), which)
        part = self._parts.get(key)
        if part is None:
            if which == "forward":
                part = _BoundPart(compiled.forward_session, compiled.split.forward)
            else:
                part = _BoundPart(compiled.backward_session, compiled.split.backward)
            self._parts[key] = part
        return part

    # ---- the step --------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self.prediction: PathPrediction = PathPrediction(path=(), execution_blocks=())
        self._own_prediction = self.prediction
        self.on_track = True
        self.mispredicted = False
        self.invocations: list[_Invocation] = []
        self.actual_path: list[int] = []
        self._phase = "forward"
        self._exec_block = -1  # index into the current phase's execution blocks
        self._phase_blocks: list[tuple[int, int]] = []
        self._forward_exec_blocks = 0  # how many the forward had (the halves keep alternating after it)
        self._backward_position = 0
        self._inputs: Sequence[torch.Tensor] = ()

    def begin_step(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction:
        """Predict the batch's path (the ``pilot_model_inference`` step) and prefetch its first
        execution block. Call before the model's forward."""
        self._reset_step()
        self._inputs = tuple(inputs)
        prediction = self.predictor.predict(model, self._inputs)
        self.stats.inference_us.append(prediction.inference_us)
        self.stats.mapping_us.append(prediction.mapping_us)
        self._own_prediction = prediction  # what the predictor said, before any correction
        if self.use_misprediction_cache:
            cached = self.misprediction_cache.lookup(prediction)
            if cached is not None:
                prediction = dataclasses.replace(cached, inference_us=prediction.inference_us,
                                                 mapping_us=prediction.mapping_us)
                self.stats.misprediction_cache_hits += 1
        self.prediction = prediction
        self._phase_blocks = list(prediction.execution_blocks)
        if self.residency == "resident":  # the whole model on the device, as without offload
            align = self.mem.arena.alignment
            model_bytes = sum(-(-t.numel() * t.element_size() // align) * align
                              for sources in self._block_sources for t in sources.values())
            if self.budget is not None and self.resident_bytes + model_bytes > self.budget:
                need = self.resident_bytes + model_bytes
                raise BudgetTooSmallError(
                    f"the resident model (parameters, gradients, optimizer state) needs {need} bytes before any "
                    f"activation but the budget is {self.budget}", needed_bytes=need, budget_bytes=self.budget)
            for block_id, sources in enumerate(self._block_sources):
                for value, tensor in sources.items():
                    name = self._param_name(block_id, value)
                    if name not in self.mem.arena:
                        self.mem.allocate(name, self.mem.source_info(tensor), protect=set(), what="the resident model")
                        self.mem.copy_in(name, tensor)
            self.mem.h2d.drain()
        elif self._phase_blocks:
            self._prefetch_group(0)
        return prediction

    def end_step(self, model: torch.nn.Module | None = None) -> None:
        """Close the step: score the prediction, log a misprediction, drop the arena copies of
        parameters (the optimizer is about to change the host copies) and anything left over."""
        self.mem.finish_step()
        true_path = tuple(self.actual_path)
        predicted = self.prediction.path
        self.stats.steps += 1
        self.stats.true_blocks += len(true_path)
        self.stats.predicted_blocks_correct += sum(1 for a, b in zip(true_path, predicted) if a == b)
        if true_path == predicted:
            self.stats.exact_paths += 1
        else:
            self.stats.mispredictions += 1
            self._log_misprediction(true_path)
        if self.use_misprediction_cache:
            self.misprediction_cache.record(self._own_prediction, true_path)
        self.step_traces = (self.step_traces + [self.trace])[-16:]
        self.trace = []
        self._reset_step()

    def _log_misprediction(self, true_path: tuple[int, ...]) -> None:
        if self.misprediction_log is not None:
            record = {
                "step": self.stats.steps,
                "inputs": [t.tolist() for t in self._inputs],
                "predicted_path": list(self.prediction.path),
                "true_path": list(true_path),
            }
            with open(self.misprediction_log, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---- executor interface ------------------------------------------------------------------

    def forward(self, compiled, block_id: int, inputs: Sequence[torch.Tensor]):
        k = len(self.invocations)
        self.actual_path.append(block_id)
        self.stats.invocations += 1
        if self.on_track and (k >= len(self.prediction.path) or self.prediction.path[k] != block_id):
            self.on_track = False
            self.mispredicted = True
        if self.on_track:
            self._enter_forward_position(k)
        part = self._part(compiled, "forward")
        self._check_fits(part, block_id)
        self.mem.cap(part.workspace_bytes, set())
        position = {n: i for i, n in enumerate(compiled.state_inputs)}
        names: dict[str, str] = {}
        protect: set[str] = set()
        for value in part.inputs:
            if value in self._block_sources[block_id]:
                names[value] = self._param_name(block_id, value)
        self._make_resident(block_id, [names[v] for v in names], protect)
        for value in part.inputs:
            if value not in names:  # an argument of the block: copy it in from torch
                names[value] = f"i{k}/{value}"
                self.mem.load(names[value], inputs[position[value]], protect)
        for value in part.outputs:
            names[value] = f"i{k}/{value}"
            self.mem.allocate(names[value], part.infos[value], protect=protect, what=f"block {block_id}'s outputs")
            protect.add(names[value])
        self._run(part, names, protect)
        ys = [torch.from_numpy(self.mem.arena.view(names[y]).copy()) for y in compiled.step.y_outputs]
        # Keep what the backward reads; free the rest of this invocation's tensors.
        backward_reads = set(compiled.split.saved) | set(compiled.split.backward_state_inputs)
        kept = {}
        for value, name in names.items():
            if value in backward_reads and name.startswith(f"i{k}/"):
                kept[value] = name
            elif name.startswith(f"i{k}/"):
                self.mem.arena.free(name)
        self.invocations.append(_Invocation(k, block_id, compiled, kept))
        if self.pre_evict:
            self._pre_evict()
        return ys, k, ()

    def backward(self, compiled, handle: int, dys: Sequence[torch.Tensor], saved_tensors) -> list[np.ndarray]:
        if self._phase == "forward":
            self._start_backward()
        record = self.invocations[handle]
        self._enter_backward_invocation(handle)
        block_id = record.block_id
        part = self._part(compiled, "backward")
        self._check_fits(part, block_id)
        self.mem.cap(part.workspace_bytes, set(record.kept.values()))
        names: dict[str, str] = {}
        protect: set[str] = set()
        params = [v for v in part.inputs if v in self._block_sources[block_id]]
        names.update({v: self._param_name(block_id, v) for v in params})
        names.update(record.kept)
        self._make_resident(block_id, list(names.values()), protect)
        for j, value in enumerate(compiled.step.dy_inputs):
            names[value] = f"i{handle}/{value}"
            self.mem.load(names[value], dys[j], protect)
        for value in part.outputs:
            names[value] = f"i{handle}/{value}"
            self.mem.allocate(names[value], part.infos[value], protect=protect, what=f"block {block_id}'s gradients")
            protect.add(names[value])
        self._run(part, names, protect)
        grads = []
        for value in compiled.backward_outputs:
            array = self.mem.arena.view(names[value]).copy()
            if value in compiled.step.grad_outputs:
                self.stats.swap_out_bytes += array.nbytes  # gradients go to the host, where the optimizer runs
                self.trace.append(TraceEvent("gradient", names[value], array.nbytes))
            grads.append(array)
        for value, name in names.items():
            if name.startswith(f"i{handle}/") and name in self.mem.arena:
                self.mem.arena.free(name)
            self.mem.host.discard(name)
        record.kept = {}
        return grads

    # ---- execution blocks and prefetch ---------------------------------------------------------

    def _enter_forward_position(self, k: int) -> None:
        """Entering forward execution block ``i`` at invocation ``k``: prefetch ``i + 1``."""
        for i, (start, _) in enumerate(self._phase_blocks):
            if start == k:
                self._exec_block = i
                if i + 1 < len(self._phase_blocks):
                    self._prefetch_group(i + 1)
                return

    def _start_backward(self) -> None:
        """The first backward call of the step: the true path is known, so the backward's
        execution blocks are the forward's (predicted ones if the prediction held, else the
        true path in groups of the same mean size), in reverse."""
        self._phase = "backward"
        n = len(self.invocations)
        if not self.mispredicted and len(self.prediction.path) == n:
            forward_blocks = list(self.prediction.execution_blocks)
        else:
            sizes = [e - s for s, e in self.prediction.execution_blocks] or [1]
            forward_blocks = list(even_groups(range(n), max(1, round(sum(sizes) / len(sizes))))) if n else []
        # Backward position p runs invocation n - 1 - p; its blocks are the forward ones mirrored.
        self._phase_blocks = [(n - end, n - start) for start, end in reversed(forward_blocks)]
        self._exec_block = -1
        self._forward_exec_blocks = len(forward_blocks)
        if self._phase_blocks:
            self._prefetch_group(0)

    def _enter_backward_invocation(self, index: int) -> None:
        n = len(self.invocations)
        p = n - 1 - index  # position in the expected backward order
        self._backward_position = p
        for i, (start, _) in enumerate(self._phase_blocks):
            if start == p:
                self._exec_block = i
                if i + 1 < len(self._phase_blocks):
                    self._prefetch_group(i + 1)
                return

    def _group_tensors(self, i: int) -> list[tuple[str, Any]]:
        """What execution block ``i`` of the current phase needs from the host: (arena name,
        source), source a torch tensor (parameter) or a host-store name (saved activation)."""
        start, end = self._phase_blocks[i]
        out: list[tuple[str, Any]] = []
        seen: set[str] = set()
        if self._phase == "forward":
            for position in range(start, end):
                block_id = self.prediction.path[position]
                for value, tensor in self._block_sources[block_id].items():
                    name = self._param_name(block_id, value)
                    if name not in seen:
                        seen.add(name)
                        out.append((name, tensor))
        else:
            n = len(self.invocations)
            for position in range(start, end):
                record = self.invocations[n - 1 - position]
                compiled = record.compiled
                for value in compiled.split.backward_state_inputs:
                    if value in self._block_sources[record.block_id]:
                        name = self._param_name(record.block_id, value)
                        if name not in seen:
                            seen.add(name)
                            out.append((name, self._block_sources[record.block_id][value]))
                for name in record.kept.values():
                    if name not in seen and name in self.mem.host:
                        seen.add(name)
                        out.append((name, name))
        return out

    def _region(self, i: int) -> tuple[int, int] | None:
        """The arena half execution block ``i`` of the current phase uses (counted across
        phases so the halves keep alternating into the backward)."""
        offset = self._forward_exec_blocks if self._phase == "backward" else 0
        return self.mem.policy.region(offset + i)

    def _prefetch_group(self, i: int) -> None:
        """Evict from the migration half what blocks ``i - 1``/``i`` do not need, as much as
        ``i``'s tensors need, and start copying them in. Stops at the first tensor that does
        not fit without evicting something needed sooner (it will be fetched on demand)."""
        if not self.prefetch:
            return
        region = self._region(i)
        wanted = self._group_tensors(i)
        protect = {name for name, _ in wanted}
        if self._exec_block >= 0:
            protect |= {name for name, _ in self._group_tensors(self._exec_block)}
        horizon = self._use_time_of_group(i)
        for name, source in wanted:
            if name in self.mem.arena or self.mem.h2d.in_flight(name):
                continue
            info = self.mem.source_info(source)
            if not self.mem.allocate(name, info, protect=protect, region=region, what="a prefetch",
                                  evict_after=horizon, required=False):
                break
            self.mem.copy_in(name, source)
            self.trace.append(TraceEvent("prefetch", name, info.nbytes))
            self.mem.prefetched.add(name)
            self.stats.prefetches += 1
            self.stats.prefetch_bytes += info.nbytes

    def _use_time_of_group(self, i: int) -> float:
        start, _ = self._phase_blocks[i]
        return self._now_of(self._phase, start)

    # ---- residency -----------------------------------------------------------------------------

    @staticmethod
    def _param_name(block_id: int, value: str) -> str:
        return f"b{block_id}/{value}"

    def _make_resident(self, block_id: int, names: Sequence[str], protect: set[str]) -> None:
        """Make ``names`` (parameters of ``block_id`` and saved tensors) resident before a part
        runs: in flight → wait; absent → tensor fault, fetched now."""
        protect.update(names)
        phase_block = self._exec_block
        for name in names:
            if name in self.mem.writing:  # being written back: keep the arena copy after all
                self.mem.wait_writeback(name)
                continue
            if self.mem.h2d.in_flight(name):
                waited, _ = self.mem.h2d.wait(name)
                self.stats.stall_time_s += waited
                self.stats.prefetch_hits += 1
                self.mem.prefetched.discard(name)
                continue
            if name in self.mem.arena:
                if name in self.mem.prefetched:
                    self.stats.prefetch_hits += 1
                    self.mem.prefetched.discard(name)
                continue
            # A tensor fault: neither resident nor in flight.
            source: Any
            if name.startswith("b"):
                value = name.split("/", 1)[1]
                source = self._block_sources[block_id][value]
            elif name in self.mem.host:
                source = name
            else:
                raise ExecutionError(f"tensor {name} is neither in the arena nor on the host")
            started = time.perf_counter()
            info = self.mem.source_info(source)
            self.mem.allocate(name, info, protect=protect, what=f"block {block_id}'s inputs")
            self.mem.copy_in(name, source)
            self.mem.h2d.wait(name)
            self.stats.stall_time_s += time.perf_counter() - started
            self.trace.append(TraceEvent("fault", name, info.nbytes))
            self.stats.faults += 1
            self.stats.fault_bytes += info.nbytes
            self.stats.fault_log.append((self.stats.steps, self._phase, phase_block, name))
            if isinstance(source, str):
                self.mem.host.discard(source)

    def _run(self, part: _BoundPart, names: dict[str, str], protect: set[str]) -> None:
        self.trace.append(TraceEvent("compute", part.model.graph.name, 0,
                                     needs=tuple(n for n in names.values() if n.startswith(("b", "i")) and n in self.mem.arena),
                                     part=part))
        self.mem.measure(part.workspace_bytes)
        self.min_budget_bytes = max(self.min_budget_bytes, self._needed(names, part))
        part.run(self.mem.arena, names)

    def _needed(self, names, part: _BoundPart) -> int:
        """The least budget this part can run under: the resident charge, its own inputs and
        outputs (aligned as the arena places them) and its workspace."""
        align = self.mem.arena.alignment
        return self.resident_bytes + part.workspace_bytes + sum(
            -(-part.infos[value].nbytes // align) * align for value in names)

    def _check_fits(self, part: _BoundPart, block_id: int) -> None:
        """Refuse, before anything moves, a part whose own tensors cannot fit the budget."""
        if self.budget is None:
            return
        need = self._needed(part.inputs + part.outputs, part)
        if need > self.budget:
            raise BudgetTooSmallError(
                f"block {block_id} ({type(self.blocks[block_id]).__name__}) needs {need} bytes of device memory "
                f"(stem/head {self.resident_bytes}, its inputs, outputs and workspace) but the budget is {self.budget}; "
                f"raise the budget to at least {need}", needed_bytes=need, budget_bytes=self.budget)

    # ---- eviction --------------------------------------------------------------------------------

    def _now(self) -> float:
        if self._phase == "forward":
            return float(len(self.invocations))
        return float(len(self.invocations) + self._backward_position)

    def _now_of(self, phase: str, position: int) -> float:
        n = max(len(self.invocations), len(self.prediction.path))
        return float(position) if phase == "forward" else float(n + position)

    def _next_use(self, name: str) -> float:
        """When ``name`` is next needed, on the timeline forward 0..n-1, backward n..2n-1
        (backward position p runs invocation n - 1 - p); infinity if never this step."""
        now = self._now()
        if self._phase == "forward":
            n = max(len(self.invocations) + 1, len(self.prediction.path))
            path = list(self.actual_path) + (list(self.prediction.path[len(self.actual_path):]) if self.on_track else [])
        else:
            n = len(self.invocations)
            path = list(self.actual_path)
        if name.startswith("i"):
            index = int(name[1:].split("/", 1)[0])
            return float(2 * n - 1 - index)
        if name.startswith("b"):
            block_id = int(name[1:].split("/", 1)[0])
            best = float("inf")
            for position, b in enumerate(path):
                if b != block_id:
                    continue
                for t in (float(position), float(2 * n - 1 - position)):
                    if t > now and t < best:
                        best = t
            return best
        return float("inf")

    # ---- asynchronous pre-eviction (DeepUM) ----------------------------------------------------

    def _pre_evict(self) -> None:
        """After a forward invocation: start writing back saved activations until what is free
        covers the largest invocation seen so far plus the next execution block's prefetch, so
        later allocations find room without waiting for a synchronous eviction."""
        if self.budget is None:
            return
        wanted = max(self.min_budget_bytes - self.resident_bytes, 0)
        if self.on_track and self._exec_block + 1 < len(self._phase_blocks):
            wanted += sum(self.mem.source_info(src).nbytes for _, src in self._group_tensors(self._exec_block + 1))
        self.mem.write_back_until_free(wanted)

    def close(self) -> None:
        self.mem.close()
