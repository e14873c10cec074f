"""Trainer checkpoints in torch's layout, so training moves between ort_offload and plain torch.

``{"model": <module state_dict>, "optimizer": <torch.optim state_dict>, "step": <updates done>}``:
what ``model.state_dict()``, ``optimizer.state_dict()`` and a step counter give in a plain
torch loop. Files are written with ``torch.save`` atomically and read with
``torch.load(weights_only=True)``; everything is checked (names, dtypes, shapes, finiteness,
step agreement) before the trainer changes. Every failure is a :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from graph_passes.ir.training_graph import Role
from ort_offload.export import optimizers
from ort_offload.export import torch_optim
from ort_offload.errors import CheckpointError, OffloadError
from ort_offload.files import atomic_open, sweep_stale_temps

TORCH_SUFFIXES = (".pt", ".pth")
KEYS = ("model", "optimizer", "step")


def is_torch_path(path: str | os.PathLike) -> bool:
    """Whether ``save`` writes ``path`` in torch's format (by its suffix)."""
    return Path(path).suffix in TORCH_SUFFIXES


def is_torch_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file ``torch.save`` wrote (a zip archive holding ``data.pkl``)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def save(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """``torch.save`` ``state`` to ``path`` atomically; refuse non-finite tensors (nothing written)."""
    path = Path(path)
    for where, tensor in _tensors(state):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"the state to save in {path} has non-finite values in {where}")
    try:
        with atomic_open(path) as f:
            torch.save(dict(state), f)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r} ({e.strerror or e}); nothing was written") from e
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """The dict a torch-format checkpoint holds (tensors and plain values only)."""
    path = Path(path)
    sweep_stale_temps(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises whatever the bytes provoke
        raise CheckpointError(f"{str(path)!r} is not a readable torch checkpoint ({type(e).__name__}): "
                              "use a file written by torch.save or trainer.save('x.pt')") from e


def _tensors(value: Any, where: str = ""):
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{where}.{key}" if where else str(key))


def _need_torch_parts(trainer) -> None:
    if trainer.model is None or trainer.optimizer_config is None:
        raise OffloadError("torch-format state needs the torch model and optimizer: build the trainer with "
                           "create_ort_trainer, or use flat_state() / load_flat_state() (state by graph name)")
    if trainer._micro:
        raise CheckpointError(f"{trainer._micro} of {trainer.accumulation_steps} micro-batches of an update are "
                              "done: take the state after the update")


def torch_state_dict(trainer) -> dict[str, Any]:
    """``trainer``'s state as ``{"model", "optimizer", "step"}`` in torch's layout."""
    _need_torch_parts(trainer)
    held = set(trainer.graph.state_inputs)
    tied = trainer.graph.tied_params
    model_state = {}
    for key, tensor in trainer.model.state_dict().items():
        source = tied.get(key, key)
        model_state[key] = (torch.from_numpy(trainer.runtime.read(source)) if source in held
                            else tensor.detach().clone())
    names = trainer.param_order or torch_optim.default_param_names(trainer.model)
    lr = trainer.scheduler.lr if trainer.scheduler is not None else trainer.lr  # the next update's
    optimizer = torch_optim.torch_optimizer_state(trainer.optimizer_config, names, trainer.runtime.read, held,
                                                  trainer.steps_done, lr)
    return {"model": model_state, "optimizer": optimizer, "step": trainer.steps_done}


def load_torch_state_dict(trainer, state: Any) -> None:
    """Resume ``trainer`` from a torch-layout state; nothing changes unless all of it fits."""
    _need_torch_parts(trainer)
    if not isinstance(state, Mapping) or sorted(state) != sorted(KEYS):
        raise CheckpointError(f"a torch-format state has keys {', '.join(KEYS)}, got "
                              f"{sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__}")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number at least 0, got {step!r}")
    flat = trainer.flat_state()
    _take_model_state(trainer, state["model"], flat)
    zeros = {n: np.zeros_like(flat[n]) for n in trainer.graph.state_inputs
             if trainer.graph.roles.get(n) == Role.OPTIMIZER_STATE and n not in (optimizers.LR_INPUT, optimizers.STEP_INPUT)}
    names = trainer.param_order or torch_optim.default_param_names(trainer.model)
    arrays, counted, lr = torch_optim.graph_optimizer_state(trainer.optimizer_config, names, state["optimizer"], zeros)
    if counted is not None and counted != step:
        raise CheckpointError(f"the optimizer state counts {counted} updates but step is {step}: the file was mixed up")
    if counted is None and step > 0 and isinstance(trainer.optimizer_config, optimizers.AdamW) and zeros:
        raise CheckpointError(f"step is {step} but the optimizer state holds no moments: save it after an update")
    flat.update(arrays)
    if optimizers.LR_INPUT in flat:
        flat[optimizers.LR_INPUT] = np.array(lr, dtype=np.float32)
    if optimizers.STEP_INPUT in flat:
        flat[optimizers.STEP_INPUT] = np.array(step + 1, dtype=np.float32)
    checked = trainer._checked_state(flat)
    trainer.load_flat_state(checked)
    trainer._step_count = step


def _take_model_state(trainer, model_state: Any, flat: dict) -> None:
    """Put ``model_state`` (a module state_dict) into ``flat`` under the graph's names."""
    expected = list(trainer.model.state_dict())
    if not isinstance(model_state, Mapping):
        raise CheckpointError(f"model state must be a module state_dict, got {type(model_state).__name__}")
    missing = [k for k in expected if k not in model_state]
    unexpected = [str(k) for k in model_state if k not in expected]
    if missing or unexpected:
        raise CheckpointError("model state does not match the model: "
                              + "; ".join(p for p in (f"missing {', '.join(missing[:3])}" if missing else "",
                                                      f"unexpected {', '.join(unexpected[:3])}" if unexpected else "") if p))
    held = set(trainer.graph.state_inputs)
    tied = trainer.graph.tied_params
    for key in expected:
        if key not in tied and key in held:  # an alias of a tied parameter repeats its first name's tensor
            flat[key] = model_state[key]
