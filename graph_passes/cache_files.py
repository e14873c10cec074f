"""The planner's own caches on disk (the measured CPU profile, measured split times): JSON
written to a temporary file beside its destination, then renamed over it, so a reader sees the
old file or the whole new one. (``ort_offload.files`` does the same for the user's outputs; the
planning layer does not import the package above it.)"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def write_json_replacing(path: str | os.PathLike, document: Any, *, indent: int | None = None) -> None:
    """Write ``document`` to ``path`` (its directory made if needed) in one rename. Raises
    OSError, with no temporary file left, where the directory cannot be written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(document, indent=indent, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


__all__ = ["write_json_replacing"]
