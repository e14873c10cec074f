"""Export-cache entries that are verified before use: each ``.onnx`` entry has a content hash
written beside it (``<entry>.sha256``, JSON), and an entry whose bytes do not match it is never
used.

A missing, truncated, emptied or edited entry (or one written before hashes existed) is reported
with a warning and exported again, so a damaged cache costs one export, never a wrong graph.
Which file an export goes to (the cache key) is decided by the exporters; this module only
writes and reads entries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

import onnx

from ort_offload.files import atomic_write_bytes, sweep_stale_temps

logger = logging.getLogger(__name__)

HASH_SUFFIX = ".sha256"


def hash_path(entry: str | os.PathLike) -> Path:
    entry = Path(entry)
    return entry.with_name(entry.name + HASH_SUFFIX)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _external_files(entry: Path) -> list[Path]:
    """Files the entry's model keeps its large tensors in (ONNX external data), beside it."""
    data = entry.with_name(entry.name + ".data")
    return [data] if data.exists() else []


def write_entry(entry: str | os.PathLike, save: Callable[[Path], object]) -> Path | None:
    """Have ``save(entry)`` write the entry (atomically), then write its content hash.

    A cache that cannot be written is not fatal: the export stands, a warning says why it was
    not cached, and None is returned."""
    entry = Path(entry)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(entry)
        save(entry)
        record = {"sha256": _digest(entry.read_bytes()),
                  "external": {p.name: _digest(p.read_bytes()) for p in _external_files(entry)}}
        atomic_write_bytes(hash_path(entry), json.dumps(record).encode())
    except OSError as e:
        logger.warning("cannot write export cache entry %s (%s); the export is used without caching it",
                       entry, e.strerror or e)
        return None
    return entry


def read_entry(entry: str | os.PathLike) -> onnx.ModelProto | None:
    """The entry's model if its bytes match the hash written with it; None when there is no
    entry, and None with a warning when it is damaged (the caller exports again)."""
    entry = Path(entry)
    try:
        data = entry.read_bytes()  # read once: what is verified is what is parsed
    except FileNotFoundError:
        return None
    except OSError as e:
        logger.warning("export cache entry %s is unreadable (%s); exporting again", entry, e.strerror or e)
        return None
    problem = _verify(entry, data)
    if problem is None:
        try:
            model = onnx.load_model_from_string(data)
            if _external_files(entry):
                onnx.load_external_data_for_model(model, str(entry.parent))
            return model
        except Exception as e:  # bytes that hash right but do not parse (written by a broken writer)
            problem = f"unreadable ({type(e).__name__})"
    logger.warning("export cache entry %s is %s; exporting again", entry, problem)
    return None


def _verify(entry: Path, data: bytes) -> str | None:
    """Why ``entry`` (whose bytes are ``data``) cannot be trusted, or None when it and its data
    files match their recorded hashes."""
    try:
        record = json.loads(hash_path(entry).read_text())
        expected, external = record["sha256"], record.get("external", {})
        if not isinstance(expected, str) or not isinstance(external, dict):
            raise ValueError(record)
    except (OSError, ValueError, KeyError, TypeError):
        return "without a valid content hash"
    try:
        if _digest(data) != expected:
            return "damaged (its content does not match its hash)"
        present = _external_files(entry)
        if sorted(p.name for p in present) != sorted(external):
            return "incomplete (its external data files are not the ones it was written with)"
        for path in present:
            if external[path.name] != _digest(path.read_bytes()):
                return f"damaged (its data file {path.name} does not match its hash)"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None
