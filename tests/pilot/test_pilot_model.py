"""The pilot net, its ONNX export through ``ai.ort_offload::pilot_model_inference``, a small
training run with a held-out family, and the :class:`pilot.Pilot` predictor."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from custom_ops import DOMAIN, default_registry
from custom_ops.pilot import PILOT_MODEL_INFERENCE, pilot_input_names
from pilot.features import feature_size
from pilot.inference import DEFAULT_PILOT_PATH, Pilot
from pilot.mapping import output_size
from pilot.model import PilotNet, export_onnx
from pilot.prediction import PathPredictor
from pilot_helpers import spec_and_architecture

SMALL_RUN_MIN_ACCURACY = 0.9
"""Exact-path accuracy the small run below must reach on held-out var-LSTM (measured: 1.0)."""


def test_op_is_registered_with_a_reference_body():
    definition = default_registry.get(PILOT_MODEL_INFERENCE)
    assert definition.function.domain == DOMAIN == "ai.ort_offload"
    assert definition.runtime_handler is None
    assert list(definition.function.input) == pilot_input_names()


def test_onnx_export_matches_torch():
    torch.manual_seed(0)
    net = PilotNet(feature_size(), output_size(), hidden=16)
    features = np.random.default_rng(0).normal(size=(5, feature_size())).astype(np.float32)
    net.set_standardization(features)
    model = export_onnx(net)
    assert [n.op_type for n in model.graph.node] == [PILOT_MODEL_INFERENCE]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for t in range(3):
        hot = np.zeros((1, 3), np.float32)
        hot[0, t] = 1
        for row in features:
            got = session.run(None, {"features": row[None], "network_type": hot})[0]
            with torch.no_grad():
                want = net(torch.as_tensor(row[None]), torch.as_tensor(hot)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def small_run():
    from ort_offload.dynamic.pilot_support import pilot_architecture
    from pilot.train import train_pilot

    return train_pilot(pilot_architecture, families=["fixed-lstm", "var-lstm"], holdout=["var-lstm"],
                       samples=600, test_samples=60, steps=2000, hidden=32)


@pytest.mark.slow  # trains a pilot model for 2000 steps (~40 s)
def test_small_training_run_generalizes_to_held_out_var_lstm(small_run):
    report = small_run.report
    assert report["trained_families"] == ["fixed-lstm"]
    assert report["families"]["var-lstm"]["held_out"]
    assert report["families"]["var-lstm"]["exact_path"] >= SMALL_RUN_MIN_ACCURACY, report
    assert report["families"]["fixed-lstm"]["exact_path"] >= SMALL_RUN_MIN_ACCURACY, report


@pytest.mark.slow  # shares the 2000-step training run above
def test_pilot_predicts_through_the_onnx_session(small_run):
    spec, arch = spec_and_architecture("var-lstm")
    pilot = Pilot(small_run.onnx_model)
    assert isinstance(pilot, PathPredictor)
    pilot.attach(spec.model, arch)
    right = 0
    for seed in range(20):
        (ids,), _ = spec.make_batch(4, seed=500 + seed)
        prediction = pilot.predict(spec.model, (ids,))
        assert prediction.inference_us > 0 and prediction.mapping_us > 0
        assert prediction.key[0] == arch.name
        right += prediction.path == tuple(spec.model.path(ids))
    assert right >= SMALL_RUN_MIN_ACCURACY * 20
    with pytest.raises(KeyError, match="attach"):
        pilot.predict(spec_and_architecture("fixed-lstm")[0].model, (ids,))


@pytest.mark.parametrize("name", ["pilot.onnx", "pilot-holdout.onnx"])
def test_committed_pilots_load_with_this_code(name):
    path = DEFAULT_PILOT_PATH.with_name(name)
    pilot = Pilot(path)
    assert pilot.session.get_inputs()[0].shape == [1, feature_size()]
    assert path.stat().st_size < 200 * 1024
