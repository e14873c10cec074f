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
    DistributedError,
    ExecutionError,
    ExportError,
    InputMismatchError,
    InvalidArgumentError,
    ModelLoadError,
    NonFiniteError,
    OffloadError,
    OutputPathError,
    UnknownDeviceError,
    UnknownModelError,
    UnsupportedGraphError,
)

__all__ = [
    "__version__",
    "Budget",
    "BudgetParseError",
    "BudgetTooSmallError",
    "CheckpointError",
    "DistributedError",
    "ExecutionError",
    "ExportError",
    "InputMismatchError",
    "InvalidArgumentError",
    "ModelLoadError",
    "NonFiniteError",
    "OffloadError",
    "OutputPathError",
    "UnknownDeviceError",
    "UnknownModelError",
    "UnsupportedGraphError",
    "format_bytes",
    "parse_budget",
]

# The trainer, device and exporter load lazily: graph_passes imports ort_offload.errors, and
# importing the package must not pull the runtime (and torch) back in.
_LAZY = {
    "OffloadDevice": "ort_offload.runtime.offload_device",
    "set_offload_device": "ort_offload.device",
    "export_forward": "ort_offload.export.training_step",
    "export_training_step": "ort_offload.export.training_step",
    "OrtTrainer": "ort_offload.trainer",
    "create_ort_trainer": "ort_offload.create_trainer",
    "offload": "ort_offload.offload_module",
    "OffloadedModule": "ort_offload.offload_module",
    "load_training_artifact": "ort_offload.export.ort_artifacts",
    "BlockwiseTrainer": "ort_offload.dynamic.trainer",
    "wrap_blocks": "ort_offload.dynamic.blockwise",
    "unwrap_blocks": "ort_offload.dynamic.blockwise",
    "export_block_step": "ort_offload.dynamic.block_export",
}
__all__ += sorted(_LAZY)


def __getattr__(name: str):
    if name == "__version__":  # read from the package metadata on first use
        from ort_offload.version import package_version

        globals()["__version__"] = package_version()
        return globals()["__version__"]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ort_offload' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
