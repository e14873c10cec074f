"""Atomic output files: written to a temporary file beside their destination, then renamed.

Readers see the old file or the whole new one, never a part. A temporary file is named
``.<name>.tmp<pid>`` (figures: ``.<stem>.tmp<pid>.png``) and removed on any error; one left by a
killed process is swept (:func:`sweep_stale_temps`) by the next write or read of the same path.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)(?P<png>\.png)?$")


def temp_path(path: str | os.PathLike, *, suffix: str = "") -> Path:
    """The temporary file this process writes ``path`` through."""
    path = Path(path)
    if suffix:
        return path.with_name(f".{path.stem}.tmp{os.getpid()}{suffix}")
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` (flushed to disk, renamed) when the block ends without error."""
    path = Path(path)
    sweep_stale_temps(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path) as f:
        f.write(data)
    return Path(path)


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], None], *, suffix: str = "") -> Path:
    """Have ``write(tmp)`` write a temporary file by name, then rename it to ``path``.

    For writers that take a file name, not a file object (matplotlib picks the format from
    ``suffix``)."""
    path = Path(path)
    sweep_stale_temps(path)
    tmp = temp_path(path, suffix=suffix)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_temps(path: str | os.PathLike) -> list[Path]:
    """Temporary files of ``path`` whose writing process no longer runs."""
    path = Path(path)
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    stale = []
    for entry in entries:
        match = _TEMP_RE.match(entry.name)
        if not match or match.group("name") != (path.stem if match.group("png") else path.name):
            continue
        if not _pid_alive(int(match.group("pid"))):
            stale.append(entry)
    return sorted(stale)


def sweep_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove what killed writers of ``path`` left behind; the files removed."""
    removed = []
    for entry in stale_temps(path):
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry)
    return removed
