"""Tests of the model zoo (models/): registry, tiny models train and export, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

import models
from models import ModelSpec, UnknownModelError, get_model, list_configs, list_models

NAMES = ["bert", "cnn", "gpt", "lstm", "mlp"]
SEQ_MODELS = ["bert", "gpt"]  # models whose sequence axis is dynamic


class LossModule(torch.nn.Module):
    """forward(*inputs, *targets) -> loss_fn(model(*inputs), *targets): what the exporter sees."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.model = spec.model
        self.loss_fn = spec.loss_fn
        self.num_inputs = len(spec.input_names)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(*args[: self.num_inputs]), *args[self.num_inputs :])


@pytest.fixture(scope="module")
def tiny_specs() -> dict[str, ModelSpec]:
    """Each tiny model built once per test module (tests must not train these in place)."""
    return {name: get_model(name, "tiny") for name in NAMES}


def _loss(spec: ModelSpec, batch=None, seq=None, *, seed=0) -> torch.Tensor:
    inputs, targets = spec.make_batch(batch, seq, seed=seed)
    return spec.loss_fn(spec.model(*inputs), *targets)


# --- registry ---------------------------------------------------------------------------


def test_list_models_sorted_and_complete():
    assert list_models() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_list_configs_has_tiny_and_small(name):
    configs = list_configs(name)
    assert configs == sorted(configs)
    assert {"tiny", "small"} <= set(configs)


def test_package_exports():
    assert set(models.__all__) == {
        "ModelSpec",
        "UnknownModelError",
        "get_model",
        "list_configs",
        "list_models",
        # the dynamic zoo (tests/ort_offload/dynamic/test_dynamic_models.py)
        "DynamicModelSpec",
        "MixedPathError",
        "get_dynamic_model",
        "list_dynamic_configs",
        "list_dynamic_models",
    }
    assert issubclass(UnknownModelError, ValueError)


@pytest.mark.parametrize("name", NAMES)
def test_spec_metadata_is_consistent(tiny_specs, name):
    spec = tiny_specs[name]
    assert spec.name == name and spec.config_name == "tiny"
    assert set(spec.dynamic_axes) == set(spec.input_names) | set(spec.target_names)
    for axes in spec.dynamic_axes.values():
        assert axes.get(0) == "batch"
        assert set(axes.values()) <= {"batch", "seq"}
    has_seq_axis = any("seq" in axes.values() for axes in spec.dynamic_axes.values())
    assert has_seq_axis == (name in SEQ_MODELS)
    assert (spec.default_seq is None) == (name in ("mlp", "cnn"))
    inputs, targets = spec.make_batch()
    assert len(inputs) == len(spec.input_names) and len(targets) == len(spec.target_names)
    for tensor in inputs + targets:
        assert tensor.shape[0] == spec.default_batch
    for tensor in targets:
        assert tensor.dtype == torch.int64


# --- tiny models: forward, loss, backward ----------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_tiny_forward_loss_backward(name):
    spec = get_model(name, "tiny")
    num_params = sum(p.numel() for p in spec.model.parameters())
    assert 5_000 <= num_params <= 200_000, num_params
    loss = _loss(spec, batch=3)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, param in spec.model.named_parameters():
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in spec.model.parameters())


@pytest.mark.parametrize("name", ["gpt", "bert", "cnn"])
def test_layers_are_a_module_list(tiny_specs, name):
    spec = tiny_specs[name]
    assert isinstance(spec.model.layers, torch.nn.ModuleList)
    assert len(spec.model.layers) == spec.config.layers
    assert any(n.startswith("layers.0.") for n, _ in spec.model.named_parameters())


def test_input_dtypes_and_shapes(tiny_specs):
    (x,), (y,) = tiny_specs["mlp"].make_batch(5)
    assert x.dtype == torch.float32 and x.shape == (5, 32) and y.shape == (5,)
    (x,), (y,) = tiny_specs["cnn"].make_batch(2)
    assert x.dtype == torch.float32 and x.shape == (2, 3, 16, 16) and y.shape == (2,)
    (ids,), (targets,) = tiny_specs["gpt"].make_batch(2)
    assert ids.dtype == torch.int64 and ids.shape == targets.shape == (2, 16)
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    assert tiny_specs["gpt"].model(ids).shape == (2, 16, 64)
    (ids,), (y,) = tiny_specs["lstm"].make_batch(2)
    assert ids.shape == (2, 8) and y.shape == (2,)
    assert tiny_specs["lstm"].model(ids).shape == (2, 4)


# --- determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_parameters_and_batches(name):
    a, b = get_model(name, seed=3), get_model(name, seed=3)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    c = get_model(name, seed=4)
    assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))
    batch_a, batch_b = a.make_batch(seed=7), b.make_batch(seed=7)
    for ta, tb in zip(batch_a[0] + batch_a[1], batch_b[0] + batch_b[1]):
        assert torch.equal(ta, tb)
    other = a.make_batch(seed=8)
    assert not torch.equal(batch_a[0][0], other[0][0])


def test_get_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    get_model("gpt")
    assert torch.equal(torch.rand(3), expected)


# --- variable sequence length -----------------------------------------------------------


@pytest.mark.parametrize("name", SEQ_MODELS)
@pytest.mark.parametrize("seq", [8, 13])
def test_variable_sequence_length(tiny_specs, name, seq):
    spec = tiny_specs[name]
    (ids,), targets = spec.make_batch(2, seq)
    assert ids.shape == (2, seq)
    with torch.no_grad():
        out = spec.model(ids)
        loss = spec.loss_fn(out, *targets)
    assert out.shape[0] == 2
    if name == "gpt":
        assert out.shape == (2, seq, spec.config.vocab)
    assert math.isfinite(loss.item())


def test_seq_longer_than_positional_table_is_rejected(tiny_specs):
    with pytest.raises(ValueError, match="seq=17"):
        tiny_specs["gpt"].make_batch(2, 17)
    longer = get_model("gpt", seq=32)
    assert longer.make_batch(2, 17)[0][0].shape == (2, 17)


def test_seq_for_model_without_sequence_axis_is_rejected(tiny_specs):
    with pytest.raises(ValueError, match="no sequence axis"):
        tiny_specs["mlp"].make_batch(2, 8)


# --- errors and overrides ---------------------------------------------------------------


def test_unknown_model_name():
    with pytest.raises(UnknownModelError) as info:
        get_model("resnet9000")
    for name in NAMES:
        assert name in str(info.value)
    with pytest.raises(ValueError):  # UnknownModelError is a ValueError
        list_configs("nope")


def test_unknown_config_name():
    with pytest.raises(UnknownModelError) as info:
        get_model("gpt", "huge")
    assert "tiny" in str(info.value) and "small" in str(info.value)


def test_unknown_override_field():
    with pytest.raises(ValueError) as info:
        get_model("gpt", width=3)
    assert not isinstance(info.value, UnknownModelError)
    for field in ("layers", "d_model", "heads", "vocab", "seq", "mlp_ratio", "dropout"):
        assert field in str(info.value)


def test_invalid_override_value():
    with pytest.raises(ValueError, match="divisible"):
        get_model("gpt", d_model=33)


def test_overrides_replace_config_fields():
    spec = get_model("gpt", layers=4, d_model=64, dropout=0.1)
    assert spec.config_name == "custom"
    assert (spec.config.layers, spec.config.d_model, spec.config.dropout) == (4, 64, 0.1)
    assert spec.config.vocab == 64  # untouched fields come from the named config
    assert len(spec.model.layers) == 4
    assert get_model("bert", layers=2).config_name == "tiny"  # no change -> still the named config
    assert len(get_model("cnn", layers=5).model.layers) == 5


# --- training ---------------------------------------------------------------------------


def test_sgd_reduces_loss_on_tiny_mlp():
    spec = get_model("mlp", "tiny")
    inputs, targets = spec.make_batch(32, seed=1)
    optimizer = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        loss = spec.loss_fn(spec.model(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# --- small configs ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_small_config_builds(name):
    spec = get_model(name, "small")
    assert spec.config_name == "small"
    num_params = sum(p.numel() for p in spec.model.parameters())
    assert 100_000 <= num_params <= 10_000_000, num_params
    tiny_params = sum(p.numel() for p in get_model(name, "tiny").model.parameters())
    assert num_params > tiny_params


# --- torch.export -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.filterwarnings("ignore:The tensor attributes self.model.lstm._flat_weights")
def test_tiny_loss_module_exports(name, dynamic):
    spec = get_model(name, "tiny")
    wrapper = LossModule(spec)
    inputs, targets = spec.make_batch()
    args = inputs + targets
    dynamic_shapes = None
    if dynamic:
        dims = {"batch": Dim("batch", min=2, max=1024)}
        if spec.default_seq is not None:
            dims["seq"] = Dim("seq", min=2, max=spec.default_seq)
        dynamic_shapes = (
            tuple(
                {axis: dims[label] for axis, label in spec.dynamic_axes[n].items()}
                for n in spec.input_names + spec.target_names
            ),
        )
    with sdpa_kernel(SDPBackend.MATH):
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes)
        exported_loss = program.module()(*args)
        eager_loss = wrapper(*args)
    torch.testing.assert_close(exported_loss, eager_loss)
    if dynamic:  # one export serves another batch size (and sequence length where dynamic)
        seq = 7 if name in SEQ_MODELS else None
        other = sum(spec.make_batch(3, seq, seed=1), ())
        with sdpa_kernel(SDPBackend.MATH):
            torch.testing.assert_close(program.module()(*other), wrapper(*other))


def test_bert_takes_sequences_up_to_max_seq():
    spec = get_model("bert", "tiny")
    assert spec.config.positions == 256 and spec.default_seq == 16
    (ids,), _ = spec.make_batch(2, 256)
    assert spec.model(ids).shape == (2, spec.config.classes)
    with pytest.raises(ValueError, match="max_seq=257"):
        spec.make_batch(2, 257)
    with pytest.raises(ValueError, match="max_seq"):
        get_model("bert", "tiny", seq=300)
