"""Train a zoo model in ort_offload and in plain torch on the same batches, for comparisons."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import torch

import ort_offload
from models import get_model


@dataclasses.dataclass
class Run:
    trainer: "ort_offload.OrtTrainer"
    losses: list[float]
    state: dict[str, np.ndarray]


def batches(name: str, steps: int, *, seq_lengths=None, config="tiny"):
    spec = get_model(name, config)
    out = []
    for step in range(steps):
        seq = None if seq_lengths is None else seq_lengths[step % len(seq_lengths)]
        out.append(spec.make_batch(seq=seq, seed=step))
    return out


def train_ort(name: str, *, steps=5, budget=None, optimizer="sgd", config="tiny", block_nodes=None,
              data=None, drop_prefetches=False, arena_policy=None, async_swap_outs=None, planning_profile=None,
              selective_recompute=True, recompute_policy="input_aware", intra_op_threads=0, **options) -> Run:
    spec = get_model(name, config)
    data = data or batches(name, steps, config=config)
    kwargs = {"max_block_nodes": block_nodes} if block_nodes else {}
    if arena_policy is not None:
        kwargs["arena_policy"] = arena_policy
    if async_swap_outs is not None:
        kwargs["async_swap_outs"] = async_swap_outs
    if planning_profile is not None:
        kwargs["planning_profile"] = planning_profile
    device = ort_offload.set_offload_device("cpu", budget=budget, drop_prefetches=drop_prefetches,
                                            selective_recompute=selective_recompute, recompute_policy=recompute_policy,
                                            intra_op_threads=intra_op_threads, **kwargs)
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
        optimizer=optimizer, name=name, **options,
    )
    losses = [trainer.step(*inputs, *targets) for inputs, targets in data]
    return Run(trainer, losses, trainer.flat_state())


def train_torch(name: str, optimizer_config, *, steps=5, config="tiny", data=None):
    spec = get_model(name, config)
    data = data or batches(name, steps, config=config)
    optimizer = optimizer_config.torch_optimizer(spec.model.parameters())
    spec.model.train()
    losses = []
    for inputs, targets in data:
        loss = spec.loss_fn(spec.model(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in spec.model.state_dict().items()}, spec.model


def max_relative_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| relative to the largest magnitude in b (per tensor)."""
    scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-12)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) / scale if b.size else 0.0


def assert_matches_torch(run: Run, torch_losses, torch_state, *, rtol=1e-5):
    for ours, theirs in zip(run.losses, torch_losses):
        assert abs(ours - theirs) <= rtol * max(abs(theirs), 1e-12), (run.losses, torch_losses)
    compared = 0
    for name, ref in torch_state.items():
        if name in run.state and np.issubdtype(ref.dtype, np.floating):
            diff = max_relative_diff(run.state[name], ref)
            assert diff <= rtol, f"{name}: relative difference {diff:.3g}"
            compared += 1
        elif name in run.state:
            np.testing.assert_array_equal(run.state[name], ref)
    assert compared >= 4


def to_torch(arrays):
    return tuple(torch.from_numpy(np.asarray(a)) for a in arrays)


_STEP_GRAPHS: dict[tuple[str, str], tuple] = {}


def step_graph_and_feeds(name: str, config: str = "tiny"):
    """A zoo model's exported step graph, values for all of its inputs (initial state, one
    batch) and the tensor infos for that signature: for running the graph in stock ORT.

    Made once per test session and model (a trainer, a step and shape inference: seconds);
    each call gets its own copy of the graph, the feeds and the infos, so a test that changes
    them changes nothing another test sees."""
    key = (name, config)
    if key not in _STEP_GRAPHS:
        from graph_passes.ir import shapes
        from ort_offload.export.training_step import initial_state

        graph = train_ort(name, optimizer="adamw", steps=1, config=config).trainer.graph
        (inputs, targets), = batches(name, 1, config=config)
        feeds = initial_state(graph, get_model(name, config).model, lr=1e-3)
        feeds.update({n: t.numpy() for n, t in zip(graph.data_inputs, inputs + targets)})
        _STEP_GRAPHS[key] = graph, feeds, shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, feeds))
    graph, feeds, infos = _STEP_GRAPHS[key]
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    graph = dataclasses.replace(graph, model=model, roles=dict(graph.roles), state_pairs=dict(graph.state_pairs))
    return graph, {n: np.array(v, copy=True) for n, v in feeds.items()}, dict(infos)  # TensorInfo is frozen


def chain_body(ops) -> tuple[list[str], str]:
    """ONNX text lines for a chain of ``ops`` from ``x`` (MatMul reads ``w``; Add/Mul and
    Concat+MatMul(``w2``) also read the value before the last, making branches); returns the
    lines and the last value's name."""
    lines, last, prev = [], "x", "x"
    for i, op in enumerate(ops):
        out = f"v{i}"
        if op == "MatMul":
            lines.append(f"{out} = MatMul({last}, w)")
        elif op in ("Add", "Mul"):
            lines.append(f"{out} = {op}({last}, {prev})")
        elif op == "Concat":
            lines.append(f"c{i} = Concat<axis = 1>({last}, {prev})")
            lines.append(f"{out} = MatMul(c{i}, w2)")
        else:
            lines.append(f"{out} = {op}({last})")
        prev, last = last, out
    return lines, last


def torch_losses(model, data, loss_fn, optimizer_config) -> list[float]:
    """Plain torch training of ``model`` on ``data`` ((inputs, targets) pairs): the losses."""
    optimizer = optimizer_config.torch_optimizer(model.parameters())
    model.train()
    losses = []
    for inputs, targets in data:
        loss = loss_fn(model(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
