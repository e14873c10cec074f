"""Pilot inference: :class:`Pilot`, the learned :class:`~pilot.prediction.PathPredictor`.

Owns :class:`Pilot` and :data:`DEFAULT_PILOT_PATH` (the trained pilot committed with the
package; ``ort-offload pilot train`` writes a new one). A :class:`Pilot` holds one ONNX Runtime
session (one thread, IOBinding to buffers bound once, so a call costs the kernels and not the
Python wrapper) and, per attached model, its :class:`~pilot.architecture.PilotArchitecture`
and :class:`~pilot.mapping.PathMapper`.

Use::

    pilot = Pilot()                       # or Pilot(path_to_onnx)
    pilot.attach(model, architecture)     # once per model (ort_offload.dynamic.pilot_support builds it)
    prediction = pilot.predict(model, (ids,))   # PathPrediction, inference_us / mapping_us set
"""

from __future__ import annotations

import copy
import os
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from pilot.architecture import PilotArchitecture
from pilot.features import AFM_SUMMARY_SIZE, NETWORK_TYPES, embedding_module, feature_size, sample_features
from pilot.mapping import PathMapper, block_unit_key, output_size
from pilot.prediction import PathPrediction

__all__ = ["DEFAULT_PILOT_PATH", "Pilot"]

DEFAULT_PILOT_PATH = Path(__file__).with_name("pilot.onnx")


class Pilot:
    """The trained pilot model behind the :class:`~pilot.prediction.PathPredictor` protocol."""

    def __init__(self, model: str | os.PathLike | onnx.ModelProto | None = None, *, threads: int = 1) -> None:
        if model is None:
            model = DEFAULT_PILOT_PATH
        if isinstance(model, onnx.ModelProto):
            source = model.SerializeToString()
        else:
            path = Path(model)
            if not path.is_file():
                raise FileNotFoundError(f"no pilot model at {path}; train one with `ort-offload pilot train`")
            source = str(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        width = self.session.get_inputs()[0].shape[1]
        if width != feature_size() or self.session.get_outputs()[0].shape[1] != output_size():
            raise ValueError(f"pilot model takes {width} features / gives {self.session.get_outputs()[0].shape[1]} "
                             f"outputs, this code needs {feature_size()} / {output_size()}: retrain it")
        self._features = np.zeros((1, feature_size()), dtype=np.float32)
        self._one_hot = np.zeros((1, len(NETWORK_TYPES)), dtype=np.float32)
        self._raw = np.zeros((1, output_size()), dtype=np.float32)
        self._binding = self.session.io_binding()
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self._features, self._one_hot, self._raw)]
        self._binding.bind_ortvalue_input("features", self._values[0])
        self._binding.bind_ortvalue_input("network_type", self._values[1])
        self._binding.bind_ortvalue_output("raw", self._values[2])
        self._attached: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[PilotArchitecture, PathMapper]]" = (
            weakref.WeakKeyDictionary()
        )

    def attach(self, model: torch.nn.Module, architecture: PilotArchitecture) -> PathMapper:
        """Prepare ``model``: its architecture features, the mapping table of its candidates and
        a snapshot of its embedding.

        The sample features come from the model's own embedding, but training moves that
        embedding step by step, and features hashed from embedding values would drift away
        from what the pilot was fit on; so the pilot embeds with the weights the model had
        when it was attached (the features a freshly built zoo model gives, as in training).
        """
        mapper = PathMapper(architecture)
        snapshot = copy.deepcopy(embedding_module(model)).requires_grad_(False)
        self._attached[model] = (architecture, mapper, snapshot)
        return mapper

    def architecture(self, model: torch.nn.Module) -> PilotArchitecture:
        return self._entry(model)[0]

    def _entry(self, model: torch.nn.Module) -> tuple[PilotArchitecture, PathMapper, torch.nn.Embedding]:
        try:
            return self._attached[model]
        except KeyError:
            raise KeyError(f"{type(model).__name__} is not attached to this pilot; call Pilot.attach(model, "
                           "architecture) first (ort_offload.dynamic.pilot_support.make_pilot does both)") from None

    def run(self, features: np.ndarray, one_hot: np.ndarray) -> np.ndarray:
        """Raw output (block units) for prebuilt ``features`` [F] and ``one_hot`` [3]; the
        returned array is the bound output buffer, overwritten by the next call."""
        self._features[0] = features
        self._one_hot[0] = one_hot
        self.session.run_with_iobinding(self._binding)
        return self._raw[0]

    def features(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> np.ndarray:
        """The pilot's input vector for a batch of ``model`` (architecture part prebuilt at attach)."""
        arch, _, embedding = self._entry(model)
        out = np.empty(feature_size(), dtype=np.float32)
        out[:AFM_SUMMARY_SIZE] = arch.summary
        out[AFM_SUMMARY_SIZE : AFM_SUMMARY_SIZE + len(NETWORK_TYPES)] = arch.one_hot
        out[AFM_SUMMARY_SIZE + len(NETWORK_TYPES) :] = sample_features(model, inputs[0], embedding=embedding)
        return out

    def predict_features(self, model: torch.nn.Module, features: np.ndarray) -> PathPrediction:
        """Prediction from prebuilt features (what the ``pilot_model_inference`` step runs)."""
        arch, mapper, _ = self._entry(model)
        start = time.perf_counter()
        raw = self.run(features, arch.one_hot)
        middle = time.perf_counter()
        index, _, _ = mapper.map(raw)
        mapped = time.perf_counter()
        return PathPrediction(
            path=mapper.paths[index],
            execution_blocks=mapper.blocks[index],
            key=(arch.name, block_unit_key(raw)),  # the misprediction cache's; not part of the mapping
            inference_us=(middle - start) * 1e6,
            mapping_us=(mapped - middle) * 1e6,
        )

    def predict(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> PathPrediction:
        """Predict the path and execution blocks of the batch ``inputs`` (``(ids,)``)."""
        return self.predict_features(model, self.features(model, inputs))
