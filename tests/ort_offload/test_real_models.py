"""What real models contain, on small modules of our own: an export cache that cannot go stale,
tied and unused parameters, non-persistent buffers, constant tensors. Losses against torch."""

from __future__ import annotations

import copy
import dataclasses
import types

import numpy as np
import pytest
import torch

import ort_offload
from ort_offload.export import training_step as export_module
from helpers import torch_losses
from ort_offload.export import optimizers
from ort_offload.export.training_step import export_training_step

ADAMW = optimizers.AdamW(lr=1e-2, weight_decay=0.01)


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


def regression_data(steps=3, batch=6, features=4, outputs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(batch, features, generator=g),), (torch.randn(batch, outputs, generator=g),))
            for _ in range(steps)]


def train_ours(model, data, loss_fn, cache_dir, *, config=ADAMW, budget=None, **options):
    device = ort_offload.set_offload_device("cpu", budget=budget)
    trainer = ort_offload.create_ort_trainer(
        device, model, loss_fn=loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        optimizer=config, cache_dir=cache_dir, **options,
    )
    return trainer, [trainer.step(*inputs, *targets) for inputs, targets in data]


def train_torch(model, data, loss_fn, *, config=ADAMW):
    return torch_losses(model, data, loss_fn, config)


def assert_trains_like_torch(make_model, data, loss_fn, cache_dir, *, rtol=1e-5, **options):
    """Train one copy in ort_offload and one in torch; losses and final weights must agree."""
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    trainer, ours = train_ours(model, data, loss_fn, cache_dir, **options)
    theirs = train_torch(reference, data, loss_fn)
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=1e-7)
    trained = trainer.copy_to(copy.deepcopy(model))
    for (name, p), (_, q) in zip(trained.named_parameters(), reference.named_parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    return trainer


# ---- item 5: the export cache cannot go stale ---------------------------------------------------


class Scaled(torch.nn.Module):
    """A plain Python attribute (not a parameter or buffer) changes what forward computes."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.linear(x) * self.scale


@dataclasses.dataclass
class FlagConfig:
    residual: bool = False


class Configured(torch.nn.Module):
    """A config object's flag picks the code path, as Hugging Face configs do."""

    def __init__(self, config: FlagConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y + x if self.config.residual else y


class Activation(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x)


class WithSubmodule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.act = Activation()

    def forward(self, x):
        return self.act(self.linear(x))


GAIN = 1.0


class UsesGlobal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * GAIN


def key_of(model, cache_dir, **options):
    """Export ``model``'s step (SGD, MSE on a fixed batch) through the cache in ``cache_dir``."""
    (inputs, targets), = regression_data(1)
    return export_training_step(model, example_inputs=inputs, example_targets=targets, loss_fn=mse,
                                optimizer="sgd", cache_dir=cache_dir, **options)


def key_only(model) -> str:
    """The cache key of ``model``'s step without exporting it."""
    (inputs, targets), = regression_data(1)
    program = export_module._capture(model, "train", mse, inputs, inputs + targets, [{}, {}])
    return export_module.cache_key(program, model, optimizers.SGD(lr=0.1), "train")


def test_a_plain_attribute_gives_a_new_export_and_trains_with_its_own_value(tmp_path):
    assert_trains_like_torch(lambda: Scaled(1.0), regression_data(), mse, tmp_path)
    assert_trains_like_torch(lambda: Scaled(3.0), regression_data(), mse, tmp_path)
    assert len(list(tmp_path.glob("*-train-*.onnx"))) == 2


@pytest.mark.slow
def test_every_change_to_what_forward_computes_gives_a_new_key(tmp_path, monkeypatch):
    torch.manual_seed(0)
    first = key_of(Configured(FlagConfig()), tmp_path)
    again = key_of(Configured(FlagConfig()), tmp_path)
    assert again.cache_hit and again.cache_key == first.cache_key  # parameter values are not part of it
    keys = {first.cache_key, key_of(Configured(FlagConfig(residual=True)), tmp_path).cache_key}
    assert len(keys) == 2  # a config flag

    base = key_of(WithSubmodule(), tmp_path)
    monkeypatch.setattr(Activation, "forward", lambda self, x: torch.tanh(x))
    changed = key_of(WithSubmodule(), tmp_path)
    assert not changed.cache_hit and changed.cache_key != base.cache_key  # a submodule's code

    plain = key_of(UsesGlobal(), tmp_path)
    monkeypatch.setitem(globals(), "GAIN", 2.0)
    assert key_of(UsesGlobal(), tmp_path).cache_key != plain.cache_key  # a global the code reads

    frozen = UsesGlobal()
    frozen.linear.bias.requires_grad_(False)
    assert key_of(frozen, tmp_path).cache_key != key_of(UsesGlobal(), tmp_path).cache_key  # what trains


@pytest.mark.parametrize("version", [pytest.param("torch", marks=pytest.mark.slow),
                                     pytest.param("exporter", marks=pytest.mark.slow), "onnxscript"])
def test_versions_of_torch_and_the_exporter_are_part_of_the_key(tmp_path, monkeypatch, version):
    base = key_of(Scaled(1.0), tmp_path).cache_key
    if version == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    elif version == "exporter":
        monkeypatch.setattr(export_module, "EXPORTER_VERSION", export_module.EXPORTER_VERSION + ".1")
    else:
        import onnxscript

        monkeypatch.setattr(onnxscript, "__version__", onnxscript.__version__ + ".1")
    assert key_of(Scaled(1.0), tmp_path).cache_key != base


def test_a_constant_tensor_attribute_is_part_of_the_key(tmp_path):
    class Masked(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.mask = mask  # a plain tensor attribute: torch.export lifts it as a constant

        def forward(self, x):
            return self.linear(x) * self.mask

    assert key_only(Masked(torch.ones(4))) != key_only(Masked(torch.tensor([1.0, 0.0, 1.0, 0.0])))


@pytest.mark.slow  # exports in a second Python process (~35 s)
def test_the_key_is_the_same_in_another_process():
    import subprocess
    import sys

    from pathlib import Path

    here = Path(__file__).resolve().parent
    script = (
        f"import torch, sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}, {str(here.parents[1])!r}];"
        " torch.manual_seed(1);"
        "from test_real_models import Scaled, key_only; print(key_only(Scaled(2.0)))"
    )
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           cwd=here.parents[1]).stdout.split()[-1]
            for _ in range(2)}
    assert keys == {key_only(Scaled(2.0))}


# ---- items 1-3: tied and unused parameters, non-persistent buffers ---------------------------------


class TiedLM(torch.nn.Module):
    """Input embedding tied to the output projection, as language models do."""

    def __init__(self, vocab=12, dim=8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class TwoNames(torch.nn.Module):
    """One Parameter registered under two names, each name used once."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.randn(4, 4) * 0.5)
        self.second = self.first

    def forward(self, x):
        return torch.tanh(x @ self.first) @ self.second.t()


class WithUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.spare = torch.nn.Linear(4, 4)  # takes no part in the loss

    def forward(self, x):
        return self.used(x)


class WithPositions(torch.nn.Module):
    """A non-persistent buffer (absent from ``state_dict()``) read by forward."""

    def __init__(self, length=5, dim=4) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(length), persistent=False)
        self.table = torch.nn.Embedding(length, dim)
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear(x + self.table(self.positions))


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_data(steps=3, batch=3, seq=5, vocab=12):
    g = torch.Generator().manual_seed(0)
    return [((torch.randint(0, vocab, (batch, seq), generator=g),), (torch.randint(0, vocab, (batch, seq), generator=g),))
            for _ in range(steps)]


def test_tied_parameters_are_one_state_tensor_with_the_gradient_of_both_uses(tmp_path):
    trainer = assert_trains_like_torch(TiedLM, token_data(), lm_loss, tmp_path)
    graph = trainer.graph
    assert graph.tied_params == {"head.weight": "emb.weight"}
    assert "emb.weight" in graph.state_inputs and "head.weight" not in graph.input_names
    logits = trainer.eval(token_data(1)[0][0][0])  # the forward export shares the one tensor too
    model = trainer.copy_to(TiedLM())
    with torch.no_grad():
        expected = model.eval()(token_data(1)[0][0][0]).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


def test_one_parameter_under_two_names_trains_like_torch(tmp_path):
    trainer = assert_trains_like_torch(TwoNames, regression_data(), mse, tmp_path)
    assert trainer.graph.tied_params == {"second": "first"}


def test_unused_parameters_are_kept_never_updated_and_reported(tmp_path):
    torch.manual_seed(0)
    before = WithUnused().spare.weight.detach().clone()
    trainer = assert_trains_like_torch(WithUnused, regression_data(), mse, tmp_path)
    assert trainer.graph.unused_params == ["spare.weight", "spare.bias"]
    np.testing.assert_array_equal(trainer.flat_state()["spare.weight"], before.numpy())


def test_non_persistent_buffers_are_state_too(tmp_path):
    trainer = assert_trains_like_torch(WithPositions, regression_data(batch=5), mse, tmp_path)
    np.testing.assert_array_equal(trainer.flat_state()["positions"], np.arange(5))


# ---- item 4: constant tensors -------------------------------------------------------------------


class Masked(torch.nn.Module):
    """A plain tensor attribute (not a buffer): torch.export lifts it as a constant tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.mask = torch.tensor([1.0, 0.0, 1.0, 0.5])

    def forward(self, x):
        return self.linear(x) * self.mask


def test_constant_tensors_become_constants_of_the_graph(tmp_path):
    trainer = assert_trains_like_torch(Masked, regression_data(), mse, tmp_path)
    assert not any(n.startswith("constant.") for n in trainer.graph.input_names)
    x = regression_data(1)[0][0][0]
    with torch.no_grad():
        expected = trainer.copy_to(Masked()).eval()(x).numpy()
    np.testing.assert_allclose(trainer.eval(x), expected, rtol=1e-5, atol=1e-6)


# ---- item 8: ATen ops the exporter cannot translate ------------------------------------------------


class SwiGLU(torch.nn.Module):
    """A gated SiLU MLP (Llama's): its backward allocates with aten.empty_permuted."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 8)
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def test_a_silu_backward_exports_and_trains_like_torch(tmp_path):
    assert_trains_like_torch(SwiGLU, regression_data(), mse, tmp_path)


class Bessel(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)


class WithBessel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.window = Bessel()

    def forward(self, x):
        return self.linear(x) * self.window(x)


def test_an_op_without_translation_is_an_export_error_naming_the_op_and_its_module(tmp_path):
    with pytest.raises(ort_offload.ExportError, match=r"bessel_j0.*module window \(Bessel\).*aten_translations"):
        key_of(WithBessel(), tmp_path)


def test_block_wise_step_keys_see_plain_attributes_and_config_objects():
    from ort_offload.dynamic.block_export import block_cache_key

    x = (torch.randn(2, 4),)
    torch.manual_seed(0)
    assert block_cache_key(Scaled(1.0), x) == block_cache_key(Scaled(1.0), x)
    assert block_cache_key(Scaled(1.0), x) != block_cache_key(Scaled(3.0), x)
    assert block_cache_key(Configured(FlagConfig()), x) != block_cache_key(Configured(FlagConfig(residual=True)), x)
