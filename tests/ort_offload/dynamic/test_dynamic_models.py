"""Tests of the dynamic zoo (models/dynamic.py and the models it registers): registry, training,
``path()`` against the blocks the forward really calls, path rules, determinism, errors."""

from __future__ import annotations

import math

import pytest
import torch

from models import (
    DynamicModelSpec,
    MixedPathError,
    UnknownModelError,
    get_dynamic_model,
    get_model,
    list_dynamic_configs,
    list_dynamic_models,
    list_models,
)
from models import moe, recycle_former, tree_lstm, var_bert

NAMES = ["fixed-bert", "fixed-lstm", "moe", "recycle-former", "tree-lstm", "var-bert", "var-lstm"]
DYNAMIC = ["moe", "recycle-former", "tree-lstm", "var-bert", "var-lstm"]
FIXED = ["fixed-bert", "fixed-lstm"]
SEEDS = range(12)


def _invoked_blocks(model: torch.nn.Module, ids: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """Run ``model(ids)`` and return (indices of the blocks called, in order; the logits)."""
    calls: list[int] = []
    handles = [
        block.register_forward_hook(lambda module, args, out, index=index: calls.append(index))
        for index, block in enumerate(model.blocks())
    ]
    try:
        logits = model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(calls), logits


# --- registry ---------------------------------------------------------------------------


def test_list_dynamic_models_and_configs():
    assert list_dynamic_models() == NAMES
    for name in NAMES:
        configs = list_dynamic_configs(name)
        assert configs == sorted(configs) and {"tiny", "small"} <= set(configs)
    assert "deep" in list_dynamic_configs("var-bert")


def test_dynamic_models_are_not_in_the_static_registry():
    assert not set(NAMES) & set(list_models())
    with pytest.raises(UnknownModelError):
        get_model("var-bert")


def test_unknown_name_config_and_field():
    with pytest.raises(UnknownModelError, match="valid dynamic models: fixed-bert"):
        get_dynamic_model("tree-cnn")
    with pytest.raises(UnknownModelError, match="valid configs: small, tiny"):
        get_dynamic_model("moe", "deep")
    with pytest.raises(ValueError, match="unknown config field"):
        get_dynamic_model("moe", experts_count=3)
    with pytest.raises(ValueError, match="divide layers"):
        get_dynamic_model("var-bert", segments=3)


def test_overrides_make_a_custom_config():
    spec = get_dynamic_model("var-bert", "tiny", layers=8)
    assert spec.config_name == "custom" and len(spec.model.blocks()) == 8
    assert get_dynamic_model("moe", "tiny", experts=1).dynamic is False
    assert get_dynamic_model("fixed-lstm", "tiny", min_seq=2).dynamic is True


@pytest.mark.parametrize("name", NAMES)
def test_spec_metadata(name):
    spec = get_dynamic_model(name)
    assert isinstance(spec, DynamicModelSpec)
    assert spec.name == name and spec.config_name == "tiny"
    assert spec.input_names == ("ids",) and spec.target_names == ("y",)
    assert spec.dynamic == (name in DYNAMIC)
    assert spec.network_type == ("transformer" if name in ("var-bert", "fixed-bert", "moe", "recycle-former") else "lstm")
    (ids,), (y,) = spec.make_batch()
    assert ids.dtype == y.dtype == torch.int64
    assert ids.shape[0] == y.shape[0] == spec.default_batch
    assert int(y.min()) >= 0 and int(y.max()) < spec.config.classes
    blocks = spec.model.blocks()
    assert blocks and all(isinstance(block, torch.nn.Module) for block in blocks)
    # blocks are registered sub-modules, so their parameters are the model's
    model_params = {id(p) for p in spec.model.parameters()}
    assert all(id(p) in model_params for block in blocks for p in block.parameters())


# --- training in plain torch ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_reaches_exactly_the_blocks_on_the_path(name):
    spec = get_dynamic_model(name)
    (ids,), (y,) = spec.make_batch(3, seed=1)
    logits = spec.model(ids)
    assert logits.shape == (3, spec.config.classes)
    loss = spec.loss_fn(logits, y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    on_path = set(spec.model.path(ids))
    for index, block in enumerate(spec.model.blocks()):
        for param in block.parameters():
            if index in on_path:
                assert param.grad is not None and torch.isfinite(param.grad).all(), index
                assert param.grad.abs().sum() > 0, index
            else:
                assert param.grad is None, index


# fixed-bert and fixed-lstm are var-bert and var-lstm on one path (`make test-all` runs them)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in FIXED else n for n in NAMES])
def test_adam_reduces_loss_on_generated_batches(name):
    spec = get_dynamic_model(name, seed=0)
    batches = [spec.make_batch(16, seed=seed) for seed in range(4)]  # several paths
    held_out = [spec.make_batch(16, seed=seed) for seed in range(100, 104)]

    def mean_loss(data) -> float:
        with torch.no_grad():
            return sum(spec.loss_fn(spec.model(ids), y).item() for (ids,), (y,) in data) / len(data)

    before, before_held_out = mean_loss(batches), mean_loss(held_out)
    optimizer = torch.optim.Adam(spec.model.parameters(), lr=1e-2)
    for step in range(20):
        (ids,), (y,) = batches[step % len(batches)]
        optimizer.zero_grad()
        spec.loss_fn(spec.model(ids), y).backward()
        optimizer.step()
    after, after_held_out = mean_loss(batches), mean_loss(held_out)
    assert after < 0.6 * before, (before, after)
    assert after_held_out < 0.85 * before_held_out, (before_held_out, after_held_out)  # learnable, not memorised


# --- path() against the forward ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_path_equals_blocks_invoked_by_forward(name):
    spec = get_dynamic_model(name)
    for seed in SEEDS:
        (ids,), _ = spec.make_batch(2, seed=seed)
        path = spec.model.path(ids)
        invoked, _ = _invoked_blocks(spec.model, ids)
        assert invoked == path, seed
        assert all(0 <= index < len(spec.model.blocks()) for index in path)


@pytest.mark.parametrize("name", DYNAMIC)
def test_dynamic_models_take_different_paths_for_different_samples(name):
    spec = get_dynamic_model(name)
    paths = {spec.model.path(spec.make_batch(2, seed=seed)[0][0]) for seed in SEEDS}
    assert len(paths) >= 3, paths


@pytest.mark.parametrize("name", FIXED)
def test_fixed_models_always_take_the_full_path(name):
    spec = get_dynamic_model(name)
    layers = spec.config.layers
    full = tuple(range(layers)) * (spec.config.seq if name == "fixed-lstm" else 1)
    for seed in SEEDS:
        (ids,), _ = spec.make_batch(2, seed=seed)
        assert spec.model.path(ids) == full


@pytest.mark.parametrize("name", DYNAMIC)
def test_batch_path_equals_each_rows_path(name):
    spec = get_dynamic_model(name)
    (ids,), _ = spec.make_batch(5, seed=3)
    path = spec.model.path(ids)
    assert all(spec.model.path(ids[row : row + 1]) == path for row in range(5))


@pytest.mark.parametrize(("name", "key_a", "key_b"), [("var-bert", 1, 3), ("moe", 0, 2), ("recycle-former", 1, 4)])
def test_batch_mixing_two_paths_is_rejected(name, key_a, key_b):
    spec = get_dynamic_model(name)
    (a,), _ = spec.make_batch(2, seed=0, key=key_a)
    (b,), _ = spec.make_batch(2, seed=1, key=key_b)
    with pytest.raises(MixedPathError, match="bucket rows"):
        spec.model.path(torch.cat([a, b]))
    with pytest.raises(MixedPathError):
        spec.model(torch.cat([a, b]))


def test_tree_batches_of_equal_length_but_different_shapes_are_rejected():
    spec = get_dynamic_model("tree-lstm")
    paths = {}
    for seed in range(40):
        (ids,), _ = spec.make_batch(1, seed=seed, key=4)
        paths.setdefault(spec.model.path(ids), ids)
    assert len(paths) >= 2  # 4 leaves: 5 shapes, all 10 tokens long
    first, second = list(paths.values())[:2]
    with pytest.raises(MixedPathError):
        spec.model.path(torch.cat([first, second]))


# --- path rules: the path is a learnable function of the sample ------------------------------


def test_var_bert_depth_follows_marker_count():
    spec = get_dynamic_model("var-bert")
    cfg = spec.config
    for segments in range(1, cfg.segments + 1):
        (ids,), _ = spec.make_batch(4, seed=segments, key=segments)
        markers = (ids == var_bert.marker_token(cfg)).sum(dim=1)
        assert markers.tolist() == [segments - 1] * 4
        assert spec.model.path(ids) == tuple(range(segments * cfg.layers_per_segment))
    # more markers than segments: capped at the full depth
    ids = torch.full((1, cfg.seq), var_bert.marker_token(cfg))
    assert spec.model.path(ids) == tuple(range(cfg.layers))


def test_recycle_former_iterations_follow_gap_count():
    spec = get_dynamic_model("recycle-former")
    cfg = spec.config
    trunk = tuple(range(cfg.layers))
    for iterations in range(1, cfg.recycles + 1):
        (ids,), _ = spec.make_batch(4, seed=iterations, key=iterations)
        gaps = (ids == recycle_former.gap_token(cfg)).sum(dim=1)
        assert gaps.tolist() == [iterations - 1] * 4
        assert spec.model.path(ids) == trunk * iterations
        assert _invoked_blocks(spec.model, ids)[0] == trunk * iterations
    # more gaps than recycles: capped; no gap: one pass of the trunk
    ids = torch.full((1, cfg.seq), recycle_former.gap_token(cfg))
    assert spec.model.path(ids) == trunk * cfg.recycles
    assert spec.model.path(torch.ones(1, cfg.seq, dtype=torch.int64)) == trunk
    # the gap is not var-BERT's marker, and the tiny embedding tables differ
    bert = get_dynamic_model("var-bert")
    assert recycle_former.gap_token(cfg) != var_bert.marker_token(bert.config)
    assert spec.model.tok_emb.weight.shape != bert.model.tok_emb.weight.shape
    assert not get_dynamic_model("recycle-former", recycles=1).dynamic


def test_recycle_former_reuses_the_trunk_weights():
    """Each iteration re-runs the same modules: the model has one trunk's parameters whatever
    the iteration count, and a deeper path accumulates gradient from every invocation."""
    spec = get_dynamic_model("recycle-former")
    one = get_dynamic_model("recycle-former", recycles=1)
    assert sum(p.numel() for p in spec.model.parameters()) == sum(p.numel() for p in one.model.parameters())
    (ids,), (y,) = spec.make_batch(2, seed=0, key=3)
    calls = []
    handle = spec.model.trunk[0].register_forward_hook(lambda m, a, out: calls.append(out))
    try:
        spec.loss_fn(spec.model(ids), y).backward()
    finally:
        handle.remove()
    assert len(calls) == 3 and not torch.equal(calls[0], calls[1])  # re-run on its own output


def test_fixed_bert_ignores_markers():
    spec = get_dynamic_model("fixed-bert")
    ids = torch.full((1, spec.config.seq), var_bert.marker_token(spec.config))
    assert spec.model.path(ids) == tuple(range(spec.config.layers))


def test_moe_routes_to_the_most_frequent_domain_token():
    spec = get_dynamic_model("moe")
    cfg = spec.config
    stride = cfg.experts + 1
    for expert in range(cfg.experts):
        (ids,), _ = spec.make_batch(4, seed=expert, key=expert)
        assert spec.model.path(ids) == tuple(
            index for layer in range(cfg.layers) for index in (layer * stride, layer * stride + 1 + expert)
        )
    domain = moe.domain_tokens(cfg)
    ids = torch.zeros(3, cfg.seq, dtype=torch.int64)
    ids[0, :2] = domain[3]  # two of expert 3 beat one of expert 1
    ids[0, 5] = domain[1]
    ids[1, 3] = domain[2]  # tie between 2 and 1: lower index wins
    ids[1, 4] = domain[1]
    # row 2: no domain token -> expert 0
    assert moe.route(cfg, ids).tolist() == [3, 1, 0]


def test_tree_lstm_path_is_the_post_order_of_the_brackets():
    spec = get_dynamic_model("tree-lstm")
    open_token, close_token = tree_lstm.bracket_tokens(spec.config)
    a, b, c = 5, 6, 7
    ids = torch.tensor([[open_token, open_token, a, b, close_token, c, close_token]])
    assert spec.model.path(ids) == (0, 0, 1, 0, 1)
    ids = torch.tensor([[open_token, a, open_token, b, c, close_token, close_token]])
    assert spec.model.path(ids) == (0, 0, 0, 1, 1)
    assert spec.model.path(torch.tensor([[a]])) == (0,)
    for leaves in range(spec.config.min_leaves, spec.config.max_leaves + 1):
        (ids,), _ = spec.make_batch(2, seed=leaves, key=leaves)
        path = spec.model.path(ids)
        assert path.count(tree_lstm.LEAF) == leaves and path.count(tree_lstm.COMPOSE) == leaves - 1
        assert ids.shape[1] == 3 * leaves - 2


@pytest.mark.parametrize(
    "tokens",
    ["", "(", "ab", "(a)", "(abc)", "(ab)c", "a(bc)", ")", "((ab)"],
)
def test_tree_parser_rejects_malformed_input(tokens):
    spec = get_dynamic_model("tree-lstm")
    open_token, close_token = tree_lstm.bracket_tokens(spec.config)
    ids = [open_token if t == "(" else close_token if t == ")" else 3 for t in tokens]
    with pytest.raises(ValueError, match="malformed tree"):
        tree_lstm.parse_tree(ids, open_token=open_token, close_token=close_token)


def test_var_lstm_path_length_is_the_sequence_length():
    spec = get_dynamic_model("var-lstm", layers=2)
    for length in (spec.config.min_seq, 7, spec.config.seq):
        (ids,), _ = spec.make_batch(2, seed=length, key=length)
        assert ids.shape == (2, length)
        assert spec.model.path(ids) == (0, 1) * length
        assert _invoked_blocks(spec.model, ids)[0] == (0, 1) * length


def test_sequence_lengths_outside_the_config_are_rejected():
    with pytest.raises(ValueError, match="S <= 8"):
        get_dynamic_model("fixed-lstm").model(torch.zeros(1, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="4 <= S"):
        get_dynamic_model("var-lstm").model(torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="S <= 16"):
        get_dynamic_model("var-bert").model(torch.zeros(1, 17, dtype=torch.int64))


@pytest.mark.parametrize(
    ("name", "key"),
    [("var-bert", 5), ("moe", 4), ("tree-lstm", 9), ("var-lstm", 13), ("fixed-lstm", 7), ("recycle-former", 5),
     ("recycle-former", 0)],
)
def test_key_outside_the_config_is_rejected(name, key):
    with pytest.raises(ValueError, match="key"):
        get_dynamic_model(name).make_batch(2, key=key)


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_generator_is_deterministic_per_seed(name):
    spec = get_dynamic_model(name)
    a, b = spec.make_batch(4, seed=7), spec.make_batch(4, seed=7)
    for ta, tb in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(ta, tb)
    others = [spec.make_batch(4, seed=seed) for seed in (8, 9)]
    assert any(o[0][0].shape != a[0][0].shape or not torch.equal(o[0][0], a[0][0]) for o in others)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_deterministic_per_seed(name):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = get_dynamic_model(name, seed=3)
    assert torch.equal(torch.rand(3), expected)  # the global RNG is untouched
    b = get_dynamic_model(name, seed=3)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    c = get_dynamic_model(name, seed=4)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))


# --- larger configs ---------------------------------------------------------------------


def test_deep_var_bert_builds_with_64_layers_and_runs_its_paths():
    spec = get_dynamic_model("var-bert", "deep")
    cfg = spec.config
    assert cfg.layers == 64 >= 48 and len(spec.model.blocks()) == 64
    assert isinstance(spec.model.layers, torch.nn.ModuleList)
    depths = {len(spec.model.path(spec.make_batch(1, seed=seed)[0][0])) for seed in range(20)}
    assert depths <= set(range(cfg.layers_per_segment, cfg.layers + 1, cfg.layers_per_segment)) and len(depths) >= 3
    (ids,), _ = spec.make_batch(1, seed=0, key=1)
    with torch.no_grad():
        invoked, logits = _invoked_blocks(spec.model, ids[:, :8])
    assert invoked == tuple(range(cfg.layers_per_segment)) and logits.shape == (1, cfg.classes)


@pytest.mark.parametrize("name", NAMES)
def test_small_config_builds_and_generates(name):
    spec = get_dynamic_model(name, "small")
    (ids,), (y,) = spec.make_batch(2, seed=0)
    assert ids.shape[0] == y.shape[0] == 2
    assert spec.model.path(ids)
    assert sum(p.numel() for p in spec.model.parameters()) > sum(
        p.numel() for p in get_dynamic_model(name, "tiny").model.parameters()
    )
