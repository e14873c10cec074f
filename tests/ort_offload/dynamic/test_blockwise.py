"""Block-wise training (ort_offload/dynamic/blockwise.py): gradients and SGD losses of every dynamic zoo
model against plain torch, one export per block structure and input signature, the forward /
backward split of a block's VJP graph, per-invocation saved activations, wrap/unwrap, errors."""

from __future__ import annotations

import copy
import logging

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from models import get_dynamic_model
from models.var_lstm import LSTMStep
from ort_offload.runtime.block_session import default_session_options
from ort_offload.dynamic.block_export import export_block_step, split_step
from ort_offload.dynamic.blockwise import BlockStepCache, default_blocks, unwrap_blocks, wrap_blocks
from ort_offload.dynamic.trainer import BlockwiseTrainer
from ort_offload.errors import CheckpointError, ExportError, InputMismatchError

logger = logging.getLogger(__name__)

REL_TOL = 1e-5
ABS_FLOOR = 1e-7  # near-zero gradients compare against this instead of their own norm

# Path parameter (``key`` of make_batch) of three batches per model: the batches take different
# paths wherever the model has more than one (depth, expert, tree shape, length).
KEYS = {
    "var-bert": (4, 1, 2),
    "fixed-bert": (1, 1, 1),
    "moe": (0, 3, 1),
    "tree-lstm": (5, 2, 8),
    "var-lstm": (12, 4, 7),
    "fixed-lstm": (8, 8, 8),
    "recycle-former": (4, 1, 2),  # trunk iterations: shared-weight blocks invoked 8, 2, 4 times
}
BATCH = 4


@pytest.fixture(scope="module")
def cache(export_cache_dir) -> BlockStepCache:
    """One compiled-step cache for the module (the disk cache is the session's export cache)."""
    return BlockStepCache(cache_dir=export_cache_dir)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / max(float(want.norm()), ABS_FLOOR))


def _grad_diffs(wrapped: nn.Module, ref: nn.Module) -> dict[str, float]:
    """Normwise relative difference of every parameter's gradient (None counts as zeros only
    when the other side is None too)."""
    diffs = {}
    for (name, p), (_, q) in zip(wrapped.named_parameters(), ref.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{name}: grad presence differs"
        if q.grad is not None:
            diffs[name] = _rel(p.grad, q.grad)
    return diffs


@pytest.mark.parametrize("name", sorted(KEYS))
def test_gradients_equal_torch(name, cache):
    spec = get_dynamic_model(name, "tiny")
    ref = copy.deepcopy(spec.model)
    wrap_blocks(spec.model, cache=cache)
    paths, worst = set(), 0.0
    for seed, key in enumerate(KEYS[name]):
        (ids,), (y,) = spec.make_batch(BATCH, seed=seed, key=key)
        path = ref.path(ids)
        paths.add(path)
        calls_before = cache.memory_hits + cache.compiled
        losses = []
        for model in (spec.model, ref):
            model.zero_grad(set_to_none=True)
            loss = spec.loss_fn(model(ids), y)
            loss.backward()
            losses.append(float(loss.detach()))
        # Every block invocation went through the cache (so through ONNX Runtime).
        assert cache.memory_hits + cache.compiled - calls_before == len(path)
        assert abs(losses[0] - losses[1]) <= REL_TOL * abs(losses[1])
        diffs = _grad_diffs(spec.model, ref)
        assert diffs and max(diffs.values()) <= REL_TOL, max(diffs.items(), key=lambda kv: kv[1])
        worst = max(worst, max(diffs.values()))
    if spec.dynamic:
        assert len(paths) == len(KEYS[name])
    logger.info("%s: max rel grad diff %.3g over %d paths", name, worst, len(paths))


def _train_beside_torch(spec, cache, optimizer: str, lr: float, batches) -> BlockwiseTrainer:
    """Train ``spec`` block-wise and a deep copy in plain torch on the same batches; assert
    every loss and, at the end, every parameter agree within REL_TOL. Returns the trainer."""
    ref = copy.deepcopy(spec.model)
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, optimizer=optimizer, lr=lr, cache=cache)
    ref_opt = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](ref.parameters(), lr=lr)
    for step, (inputs, targets) in enumerate(batches):
        got = trainer.step(*inputs, *targets)
        ref_opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(ref(*inputs), *targets)
        loss.backward()
        ref_opt.step()
        want = float(loss.detach())
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want)
    for (pname, p), (_, q) in zip(spec.model.named_parameters(), ref.named_parameters(), strict=True):
        assert _rel(p.detach(), q.detach()) <= REL_TOL, pname
    trainer.close()
    return trainer


@pytest.mark.parametrize("name", sorted(KEYS))
def test_sgd_losses_equal_torch(name, cache):
    spec = get_dynamic_model(name, "tiny")
    batches = [spec.make_batch(BATCH, seed=10 + seed, key=key) for seed, key in enumerate(KEYS[name])]
    trainer = _train_beside_torch(spec, cache, "sgd", 0.1, batches)
    assert len(trainer.losses) == len(KEYS[name])
    assert all("forward" not in block.__dict__ for block in spec.model.blocks())


def test_adamw_steps_equal_torch(cache):
    spec = get_dynamic_model("var-lstm", "tiny")
    batches = [spec.make_batch(BATCH, seed=20 + seed, key=key) for seed, key in enumerate((6, 12, 4))]
    _train_beside_torch(spec, cache, "adamw", 1e-2, batches)


def test_state_dict_moves_to_plain_torch_and_back(cache):
    """The torch-layout state of a block-wise trainer continues in plain torch with the same next
    loss and loads back; a misfit is one CheckpointError with nothing changed."""
    spec = get_dynamic_model("var-lstm", "tiny")
    batches = [spec.make_batch(BATCH, seed=30 + seed, key=key) for seed, key in enumerate((6, 12, 4))]
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, optimizer="adamw", lr=1e-2, cache=cache)
    for inputs, targets in batches[:2]:
        trainer.step(*inputs, *targets)
    state = trainer.state_dict()
    assert sorted(state) == ["model", "optimizer", "step"] and state["step"] == 2
    ref = copy.deepcopy(get_dynamic_model("var-lstm", "tiny").model)
    ref.load_state_dict(state["model"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(state["optimizer"])
    name = next(iter(state["model"]))
    before = trainer.flat_state()
    for bad in ({**state, "model": {**state["model"], name: state["model"][name].double()}},
                {**state, "optimizer": {**state["optimizer"], "param_groups": []}},
                {**state, "optimizer": {**state["optimizer"], "state": {99: {}}}},
                {**state, "step": -1}, {"model": state["model"]}):
        with pytest.raises(CheckpointError):
            trainer.load_state_dict(bad)
    assert all(np.array_equal(v, trainer.flat_state()[k]) for k, v in before.items())
    trainer.load_state_dict(state)
    inputs, targets = batches[2]
    got = trainer.step(*inputs, *targets)
    want = spec.loss_fn(ref(*inputs), *targets)
    assert abs(got - want.item()) <= REL_TOL * abs(want.item()) and trainer.steps_done == 3
    trainer.close()


def test_each_block_signature_exported_once(tmp_path):
    cache = BlockStepCache(cache_dir=tmp_path)
    spec = get_dynamic_model("var-bert", "tiny")
    wrap_blocks(spec.model, cache=cache)
    (ids,), _ = spec.make_batch(BATCH, seed=0, key=4)
    spec.model(ids).sum().backward()
    # Four layers of one structure and one signature: one export serves all of them.
    assert (cache.exports, cache.compiled, cache.memory_hits) == (1, 1, 3)
    (ids,), _ = spec.make_batch(BATCH, seed=1, key=2)  # another path, same shapes
    spec.model(ids).sum().backward()
    assert (cache.exports, cache.compiled) == (1, 1)
    (ids,), _ = spec.make_batch(BATCH + 1, seed=2, key=1)  # a new signature
    spec.model(ids).sum().backward()
    assert (cache.exports, cache.compiled) == (2, 2)
    assert len(cache.export_times_s) == 2 and all(t > 0 for t in cache.export_times_s)
    logger.info("BERTBlock step export: %s s", ", ".join(f"{t:.2f}" for t in cache.export_times_s))
    # A new process (a new cache on the same directory) loads from disk instead of exporting.
    fresh = BlockStepCache(cache_dir=tmp_path)
    other = get_dynamic_model("var-bert", "tiny", seed=3)
    wrap_blocks(other.model, cache=fresh)
    (ids,), _ = other.make_batch(BATCH, seed=0, key=1)
    other.model(ids).sum().backward()
    assert (fresh.exports, fresh.disk_hits) == (0, 1)


def test_moe_exports_once_per_block_structure(tmp_path):
    """Eight expert blocks and two attention blocks of two structures: two exports in all."""
    cache = BlockStepCache(cache_dir=tmp_path)
    spec = get_dynamic_model("moe", "tiny")
    wrap_blocks(spec.model, cache=cache)
    for seed, expert in enumerate((0, 2, 3)):
        (ids,), _ = spec.make_batch(BATCH, seed=seed, key=expert)
        spec.model(ids).sum().backward()
        assert (cache.exports, cache.compiled) == (2, 2)
    assert sorted(c.step.model.graph.name for c in cache.steps.values()) == ["AttentionBlock_vjp", "ExpertBlock_vjp"]


def _example(block: nn.Module, args, seed: int = 0):
    """Random dy per output of ``block(*args)``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = block(*args)
    outs = out if isinstance(out, tuple) else (out,)
    return [torch.randn(o.shape, generator=generator) for o in outs]


def _split_cases():
    generator = torch.Generator().manual_seed(0)
    bert = get_dynamic_model("var-bert", "tiny").model.layers[0]
    cell = get_dynamic_model("tree-lstm", "tiny").model.cells[1]
    step = get_dynamic_model("var-lstm", "tiny").model.steps[0]
    return [
        ("bert", bert, (torch.randn(2, 16, 32, generator=generator),)),
        ("compose", cell, tuple(torch.randn(2, 32, generator=generator) for _ in range(4))),
        ("lstm", step, tuple(torch.randn(2, 32, generator=generator) for _ in range(3))),
    ]


@pytest.mark.parametrize("case", _split_cases(), ids=lambda c: c[0])
def test_split_parts_equal_whole_step(case, export_cache_dir):
    _, block, args = case
    step = export_block_step(block, args, cache_dir=export_cache_dir)
    parts = split_step(step)
    forward_inputs = [v.name for v in parts.forward.graph.input]
    assert not set(forward_inputs) & set(step.dy_inputs)
    assert parts.saved and not set(parts.saved) & set(step.dy_inputs)
    assert [v.name for v in parts.backward.graph.input][: len(step.dy_inputs)] == list(step.dy_inputs)
    # Every backward node depends on a dy, computes a constant, or passes a zero gradient through.
    constants = {t.name for t in parts.backward.graph.initializer}
    tainted = set(step.dy_inputs)
    for node in parts.backward.graph.node:
        if any(n in tainted for n in node.input):
            tainted.update(node.output)
        elif all(n in constants for n in node.input if n):
            constants.update(node.output)
        else:
            assert node.name.startswith("split/passthrough/"), node.name

    params = [p.detach() for p in block.parameters()]
    dys = _example(block, args)
    feeds = dict(zip(step.arg_inputs, [a.numpy() for a in args]))
    feeds.update(zip(step.param_inputs, [p.numpy() for p in params]))
    feeds.update(zip(step.dy_inputs, [d.numpy() for d in dys]))
    options = default_session_options()
    whole = ort.InferenceSession(step.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in whole.get_outputs()]
    expected = dict(zip(outputs, whole.run(outputs, feeds)))

    fwd = ort.InferenceSession(parts.forward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    bwd = ort.InferenceSession(parts.backward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fwd_out = [o.name for o in fwd.get_outputs()]
    first = dict(zip(fwd_out, fwd.run(fwd_out, {n: feeds[n] for n in forward_inputs})))
    bwd_feeds = {n: feeds[n] for n in step.dy_inputs}
    bwd_feeds.update({n: first[n] for n in parts.saved})
    bwd_feeds.update({n: feeds[n] for n in parts.backward_state_inputs})
    bwd_out = [o.name for o in bwd.get_outputs()]
    second = dict(zip(bwd_out, bwd.run(bwd_out, bwd_feeds)))
    got = {n: first[n] for n in step.y_outputs} | second
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)

    # And the whole step equals torch's VJP.
    x = [a.clone().requires_grad_(True) for a in args]
    out = block(*x)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs, x + list(block.parameters()), dys)
    want = [o.detach() for o in outs] + list(grads)
    for name, w in zip(step.y_outputs + step.dx_outputs + step.grad_outputs, want, strict=True):
        assert _rel(torch.from_numpy(expected[name]), w) <= REL_TOL, name


def test_saved_activations_are_per_invocation(cache):
    """One block called three times in a chain: each backward uses its own call's activations."""
    step = LSTMStep(32, 32)
    ref = copy.deepcopy(step)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 32, generator=generator) for _ in range(3)]
    weights = torch.randn(3, 32, generator=generator)

    def run(module):
        h = torch.zeros(3, 32, requires_grad=True)
        c = torch.zeros(3, 32)
        for x in xs:
            h, c = module(x, h, c)
        return (h * weights).sum() + c.square().sum()

    holder = nn.ModuleList([step])
    wrap_blocks(holder, cache=cache)
    run(step).backward()
    run(ref).backward()
    for (name, p), q in zip(step.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= REL_TOL, name
    unwrap_blocks(holder)


class _Plain(nn.Module):
    """No blocks(): its blocks are the children of its ModuleLists (nested ones included)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.pairs = nn.ModuleList([nn.ModuleList([_Unused(), nn.Tanh()])])

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.pairs[0][1](self.pairs[0][0](x))


class _Unused(nn.Module):
    """A block with a parameter its output does not depend on (its gradient is zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * 2.0


def test_default_blocks_and_zero_gradient_passthrough(cache):
    torch.manual_seed(0)
    model = _Plain()
    blocks = default_blocks(model)
    assert blocks == [model.layers[0], model.layers[1], model.pairs[0][0], model.pairs[0][1]]
    ref = copy.deepcopy(model)
    wrap_blocks(model, cache=cache)
    x = torch.randn(5, 6)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name.endswith("spare"):  # torch leaves an unused parameter's grad None; we give zeros
            assert q.grad is None and torch.count_nonzero(p.grad) == 0
            continue
        assert _rel(p.grad, q.grad) <= REL_TOL, name
    unwrap_blocks(model)
    assert all("forward" not in b.__dict__ for b in blocks)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


class _Lookup(nn.Module):
    """A block with an integer argument (no dx for it) between two floating ones."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x, idx, scale):
        return self.lin(x + self.table(idx)) * scale, x * scale


def test_integer_argument_and_tuple_output(cache):
    torch.manual_seed(0)
    block = _Lookup()
    ref = copy.deepcopy(block)
    idx = torch.tensor([1, 7, 3])
    grads = []
    for module, wrap in ((block, True), (ref, False)):
        holder = nn.ModuleList([module])
        if wrap:
            wrap_blocks(holder, cache=cache)
        x = torch.linspace(-1, 1, 24).reshape(3, 8).requires_grad_(True)
        scale = torch.full((3, 1), 0.5, requires_grad=True)
        a, b = module(x, idx, scale)
        (a.square().sum() + b.sum()).backward()
        grads.append([x.grad, scale.grad] + [p.grad for p in module.parameters()])
    for got, want in zip(*grads, strict=True):
        assert _rel(got, want) <= REL_TOL


def test_unwrap_restores_original_forward(cache):
    spec = get_dynamic_model("var-lstm", "tiny")
    (ids,), _ = spec.make_batch(BATCH, seed=0, key=5)
    with torch.no_grad():
        before = spec.model(ids)
        wrap_blocks(spec.model, cache=cache)
        wrapped = spec.model(ids)
        unwrap_blocks(spec.model)
        after = spec.model(ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert _rel(wrapped, before) <= REL_TOL
    wrap_blocks(spec.model, cache=cache)  # wrapping again after unwrap works
    unwrap_blocks(spec.model)


def test_errors(cache):
    spec = get_dynamic_model("var-lstm", "tiny")
    wrap_blocks(spec.model, cache=cache)
    step = spec.model.steps[0]
    x = torch.zeros(2, 32)
    with pytest.raises(ExportError, match="keyword"):
        step(x, x, c=x)
    with pytest.raises(ExportError, match="tensor arguments only"):
        step(x, x, 1.0)
    with pytest.raises(InputMismatchError, match="CPU tensors"):
        step(x.to("meta"), x, x)
    with pytest.raises(InputMismatchError, match="already wrapped"):
        wrap_blocks(spec.model, cache=cache)
    unwrap_blocks(spec.model)
    with pytest.raises(InputMismatchError, match="no blocks"):
        wrap_blocks(nn.Linear(2, 2), cache=cache)
    with pytest.raises(InputMismatchError, match="unknown optimizer"):
        BlockwiseTrainer(spec.model, spec.loss_fn, optimizer="lion")

    class IntOut(nn.Module):
        def forward(self, x):
            return x.argmax(dim=-1)

    with pytest.raises(ExportError, match="floating"):
        export_block_step(IntOut(), (x,), use_cache=False)
