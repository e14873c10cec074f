"""Checkpoint files: an ``.npz`` of the state tensors plus JSON metadata, written atomically and
validated completely before a trainer changes anything.

A checkpoint holds ``__meta__`` (JSON: ``format``, ``model``, ``steps``, ``losses``) and one
``state/<name>`` array per state tensor. :func:`read_checkpoint` checks the format and the
metadata's types; :func:`check_state` checks names, dtypes, shapes and finiteness against what a
trainer holds. Every failure, I/O included, is a :class:`CheckpointError`. A save killed midway
leaves only its temporary file, which the next save or load of the same path sweeps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ort_offload.errors import CheckpointError
from ort_offload.files import atomic_open, sweep_stale_temps

CHECKPOINT_FORMAT = "ort_offload.checkpoint.v1"
META_KEY = "__meta__"
STATE_PREFIX = "state/"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint file holds: metadata and the state tensors by name."""

    model: str
    steps: int
    losses: list[float]
    state: dict[str, np.ndarray]


def write_checkpoint(path: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``path`` atomically; refuse non-finite state (nothing is written)."""
    path = Path(path)
    _check_finite(checkpoint.state, f"the state to save in {path}")
    meta = {"format": CHECKPOINT_FORMAT, "model": checkpoint.model, "steps": checkpoint.steps,
            "losses": [v if math.isfinite(v) else None for v in checkpoint.losses]}
    entries = {f"{STATE_PREFIX}{k}": v for k, v in checkpoint.state.items()}
    try:
        with atomic_open(path) as f:
            np.savez(f, **{META_KEY: np.array(json.dumps(meta, allow_nan=False))}, **entries)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r} ({e.strerror or e}); nothing was written") from e
    return path


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and check a checkpoint file's format and metadata (not yet its fit to a trainer)."""
    path = Path(path)
    sweep_stale_temps(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    if path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a directory, not a checkpoint")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise ValueError("a single array, not an archive")
            entries = {k: data[k] for k in data.files}
    except Exception as e:  # np.load raises whatever the bytes provoke: EOFError, BadZipFile, zlib.error...
        raise CheckpointError(f"{str(path)!r} is not an ort_offload checkpoint ({type(e).__name__}): "
                              "use a file written by trainer.save()") from e
    meta = _read_meta(entries.pop(META_KEY, None), path)
    unknown = sorted(k for k in entries if not k.startswith(STATE_PREFIX))
    if unknown:
        raise CheckpointError(f"{str(path)!r} holds entries that are not state: {', '.join(unknown[:3])}")
    state = {k[len(STATE_PREFIX):]: v for k, v in entries.items()}
    return Checkpoint(model=meta["model"], steps=meta["steps"], losses=meta["losses"], state=state)


def _read_meta(raw: np.ndarray | None, path: Path) -> dict[str, Any]:
    """The metadata, with every field of the type it must have."""
    where = f"checkpoint {str(path)!r}"
    if raw is None or raw.dtype.kind != "U" or raw.ndim != 0:
        raise CheckpointError(f"{where} has no metadata: use a file written by trainer.save()")
    try:
        meta = json.loads(str(raw))
    except ValueError as e:
        raise CheckpointError(f"{where}: its metadata is not JSON") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: its metadata is a {type(meta).__name__}, not an object")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{where} has format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    steps, losses, model = meta.get("steps"), meta.get("losses"), meta.get("model")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise CheckpointError(f"{where}: steps must be a whole number at least 0, got {steps!r}")
    if not isinstance(losses, list) or not all(
            v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)) for v in losses):
        raise CheckpointError(f"{where}: losses must be a list of numbers, got {type(losses).__name__}")
    if not isinstance(model, str):
        raise CheckpointError(f"{where}: model must be a name, got {model!r}")
    return {"model": model, "steps": steps, "losses": [math.nan if v is None else float(v) for v in losses]}


def check_state(state: Any, expected: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """``state`` as C-contiguous arrays if it has exactly the ``expected`` names, dtypes and shapes
    and only finite floating-point values; else :class:`CheckpointError`, naming the first misfit."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a state is a mapping of names to arrays, got {type(state).__name__}")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected), key=str)
    if missing or unexpected:
        raise CheckpointError(
            "state does not match this trainer: "
            + (f"missing {', '.join(missing[:3])}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {', '.join(map(str, unexpected[:3]))}" if unexpected else "")
        )
    arrays = {}
    for name, (dtype, shape) in expected.items():
        array = _as_array(state[name], name)
        if array.dtype != dtype or tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{name}: checkpoint has {array.dtype}{list(array.shape)}, trainer has {dtype}{list(shape)}")
        arrays[name] = array
    _check_finite(arrays, "the state")
    return arrays


def _as_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().contiguous().numpy()
    try:
        array = np.asarray(value)
    except Exception as e:
        raise CheckpointError(f"{name}: {type(value).__name__} is not an array") from e
    return array if array.flags.c_contiguous else array.copy(order="C")


def _check_finite(state: Mapping[str, np.ndarray], what: str) -> None:
    for name, array in state.items():
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
            raise CheckpointError(f"{what} has non-finite values in {name}: a checkpoint holds finite numbers only")
