"""Micro-op times measured in ONNX Runtime, kept on disk per machine.

The split planner charges each candidate split the times of its micro-ops measured on this
machine (:func:`graph_passes.planning.split.cost.measure_node_times`). Measured again in every
process, the times move with the machine's load and near ties between axes go another way, so
the same graph and budget would get another split plan in each run. Kept here, a node signature
measured once keeps its time in every later process on the same CPU model and ONNX Runtime
version, and the plan stays the same.

The file is ``split_times.json`` beside the measured CPU profile
(:func:`graph_passes.cost.device_profiles.profile_cache_dir`): one object per machine key,
mapping a digest of the node signature to seconds (``null``: the node cannot run alone). A file
that cannot be read, or entries that are not times, are ignored with a warning (they are measured
again); a cache that cannot be written costs a re-measurement in the next process, nothing else.
Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

from graph_passes.cache_files import write_json_replacing
from graph_passes.cost.device_profiles import cpu_model_name, profile_cache_dir

logger = logging.getLogger(__name__)

FILE_NAME = "split_times.json"


def machine_key() -> str:
    """What measured times depend on besides the node: the CPU model and ONNX Runtime's version."""
    import onnxruntime as ort

    return f"{cpu_model_name()}; onnxruntime {ort.__version__}"


def signature_digest(signature: tuple) -> str:
    """A stable name for a node signature (op type, domain, attributes, input dtypes and shapes)."""
    return hashlib.sha256(repr(signature).encode("utf-8")).hexdigest()[:32]


def _is_time(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value) and value > 0)


class MeasuredTimes:
    """Seconds by node signature (``None``: not measurable alone), read from and written to
    ``directory`` (default: the profile cache, looked up at each use, so a changed
    ``ORT_OFFLOAD_CACHE_DIR`` is followed: the new file is read, and times measured but not yet
    saved under the old one are dropped). :meth:`save` writes what was measured since."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self._directory = Path(directory) if directory is not None else None
        self._path: Path | None = None  # the file ``_times`` was read from
        self._times: dict[str, float | None] = {}
        self._unsaved: dict[str, float | None] = {}

    @property
    def path(self) -> Path:
        return (self._directory if self._directory is not None else profile_cache_dir()) / FILE_NAME

    def __contains__(self, signature: tuple) -> bool:
        return signature_digest(signature) in self._current()

    def __getitem__(self, signature: tuple) -> float | None:
        return self._current()[signature_digest(signature)]

    def __setitem__(self, signature: tuple, seconds: float | None) -> None:
        if not _is_time(seconds):
            raise ValueError(f"a measured time is positive seconds or None, got {seconds!r}")
        digest = signature_digest(signature)
        self._current()[digest] = seconds
        self._unsaved[digest] = seconds

    def __len__(self) -> int:
        return len(self._current())

    def save(self) -> None:
        """Merge the times measured since the last save into the file (written atomically)."""
        if not self._unsaved:
            return
        path = self.path
        document = _read(path)
        entries = document.setdefault(machine_key(), {})
        entries.update(self._unsaved)
        try:
            write_json_replacing(path, document)
        except OSError as e:
            logger.warning("could not keep measured split times in %s (%s); they are measured again next time", path, e)
        self._unsaved.clear()

    def _current(self) -> dict[str, float | None]:
        path = self.path
        if path != self._path:
            self._path, self._unsaved = path, {}
            self._times = dict(_read(path).get(machine_key(), {}))
        return self._times


def _read(path: Path) -> dict[str, dict[str, float | None]]:
    """The file's machine entries, its bad parts dropped with a warning; {} if absent."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable split times %s (%s)", path, e)
        return {}
    if not isinstance(document, dict):
        logger.warning("ignoring split times %s: not a JSON object", path)
        return {}
    kept: dict[str, dict[str, float | None]] = {}
    for machine, entries in document.items():
        if not isinstance(entries, dict):
            logger.warning("ignoring the split times of %r in %s: not an object", machine, path)
            continue
        good = {k: v for k, v in entries.items() if isinstance(k, str) and _is_time(v)}
        if len(good) < len(entries):
            logger.warning("ignoring %d split times of %r in %s that are not positive seconds",
                           len(entries) - len(good), machine, path)
        kept[machine] = good
    return kept


__all__ = ["FILE_NAME", "MeasuredTimes", "machine_key", "signature_digest"]
