"""The CUDA device on a real GPU: planned runs bitwise equal to the unplanned one on the same
GPU, losses within 1e-5 of torch on that GPU (fp32, TF32 off), the budget by the device's own
counter. Skipped where onnxruntime-gpu or a GPU is missing (CI); run with ``make test-gpu``."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
if "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
    pytest.skip("needs onnxruntime-gpu and a CUDA GPU", allow_module_level=True)

import ort_offload  # noqa: E402
from helpers import batches  # noqa: E402
from models import get_model  # noqa: E402
from ort_offload.export import optimizers  # noqa: E402

STEPS = 3


def train_cuda(budget=None, **options):
    spec = get_model("gpt", "tiny")
    data = batches("gpt", STEPS)
    device = ort_offload.set_offload_device("cuda", budget=budget, async_swap_outs=True)
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        input_names=spec.input_names, target_names=spec.target_names, optimizer="adamw", name="gpt", **options,
    )
    losses = [trainer.step(*inputs, *targets) for inputs, targets in data]
    return trainer, losses, trainer.flat_state()


@pytest.fixture(scope="module")
def unplanned():
    return train_cuda()


def test_unplanned_losses_match_torch_on_the_same_gpu(unplanned):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = get_model("gpt", "tiny")
    model = spec.model.cuda()
    optimizer = optimizers.make_optimizer("adamw", lr=1e-3).torch_optimizer(model.parameters())
    expected = []
    for inputs, targets in batches("gpt", STEPS):
        optimizer.zero_grad()
        loss = spec.loss_fn(model(*[t.cuda() for t in inputs]), *[t.cuda() for t in targets])
        loss.backward()
        optimizer.step()
        expected.append(float(loss))
    _, losses, _ = unplanned
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


@pytest.mark.parametrize("budget,options", [("0.5x", {"passes": "swap"}), ("0.7x", {"passes": "recompute"}),
                                            ("0.5x", {"passes": "auto"})])
def test_planned_runs_are_bitwise_the_unplanned_run_within_budget(unplanned, budget, options):
    trainer, losses, state = train_cuda(budget, **options)
    _, reference_losses, reference_state = unplanned
    assert losses == reference_losses
    for name, value in reference_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    report = trainer.report()
    assert report["within_budget"]
    assert trainer.runtime.stats.measured_device_bytes is not None
