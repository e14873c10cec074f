"""The pilot model of DyNN-Offload: idiom features (AFM), the predictor of execution blocks,
its training-data generator and trainer, ONNX export and the ``pilot_model_inference`` op.

Modules, one responsibility each:

- :mod:`pilot.prediction`: :class:`PathPrediction` and the :class:`PathPredictor` protocol
  shared with the runtime; the oracle and no-prediction predictors.
- :mod:`pilot.idioms`: the idiom table (six idioms per ONNX op type) and op signatures.
- :mod:`pilot.features`: block profiles, the AFM and its fixed-size summary, the network-type
  one-hot, the sample features from the model's own embedding.
- :mod:`pilot.paths`: candidate paths of each dynamic family's static architecture.
- :mod:`pilot.partition`: the partition simulator (labels) and the even-split heuristics.
- :mod:`pilot.traces`: the execution-trace generator (JSON).
- :mod:`pilot.architecture`: :class:`PilotArchitecture`, all of the above for one model.
- :mod:`pilot.mapping`: the output encoding and the mapping back to a path.
- :mod:`pilot.model`: the three parallel MLPs and their ONNX export.
- :mod:`pilot.train`: data generation, training with held-out families, evaluation.
- :mod:`pilot.inference`: :class:`Pilot`, the ONNX Runtime predictor.

This package never imports ``ort_offload``; ``ort_offload.dynamic.pilot_support`` exports the block
graphs and hands them in (``make_pilot(spec)`` gives a ready :class:`Pilot`).
"""

from pilot.prediction import NoPredictor, OraclePredictor, PathPrediction, PathPredictor, even_groups

__all__ = ["NoPredictor", "OraclePredictor", "PathPrediction", "PathPredictor", "Pilot", "even_groups"]


def __getattr__(name: str):
    if name == "Pilot":  # imported lazily: onnxruntime is not needed for the protocol alone
        from pilot.inference import Pilot

        return Pilot
    raise AttributeError(f"module 'pilot' has no attribute {name!r}")
