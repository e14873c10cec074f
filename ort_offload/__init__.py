"""ort_offload: train neural networks whose working set exceeds device memory, on ONNX Runtime.

Two lines turn a torch model into a trainer that runs under a device-memory budget::

    device = ort_offload.set_offload_device("cpu", budget="64MiB")
    trainer = ort_offload.create_ort_trainer(device, model, loss_fn=loss_fn,
                                             example_inputs=(x,), example_targets=(y,))
    loss = trainer.step(x, y)
"""

from ort_offload.budget import Budget, format_bytes, parse_budget
from ort_offload.errors import (
    BudgetParseError,
    BudgetTooSmallError,
    CheckpointError,
    ExportError,
    InputMismatchError,
    ModelLoadError,
    OffloadError,
    UnknownDeviceError,
    UnknownModelError,
    UnsupportedGraphError,
)

__all__ = [
    "Budget",
    "BudgetParseError",
    "BudgetTooSmallError",
    "CheckpointError",
    "ExportError",
    "InputMismatchError",
    "ModelLoadError",
    "OffloadError",
    "UnknownDeviceError",
    "UnknownModelError",
    "UnsupportedGraphError",
    "format_bytes",
    "parse_budget",
]

from ort_offload.device import OffloadDevice, set_offload_device  # noqa: E402
from ort_offload.export import export_forward, export_training_step  # noqa: E402
from ort_offload.trainer import OrtTrainer, create_ort_trainer  # noqa: E402

__all__ += [
    "OffloadDevice",
    "OrtTrainer",
    "create_ort_trainer",
    "export_forward",
    "export_training_step",
    "set_offload_device",
]
