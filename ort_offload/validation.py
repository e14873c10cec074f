"""Checks of user-given values before anything runs: counts, seeds, learning rates, paths.

The CLI and the Python API share them, so both refuse the same values with the same one-line
errors, and a refused command has written and changed nothing. Budgets are checked where they
are parsed (:func:`ort_offload.budget.parse_budget`).
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Iterable, Mapping

from ort_offload.errors import InvalidArgumentError, OutputPathError

MAX_SEED = 2**31 - 1
# Room in a file name for the temporary file it is written through (".<name>.tmp<pid>.png").
_TEMP_NAME_EXTRA = 20

PathLike = str | os.PathLike


def check_count(value, *, name: str, minimum: int = 1, maximum: int | None = None, hint: str = "") -> int:
    """``value`` as an int if it is a whole number in ``[minimum, maximum]``; ``hint`` ends the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be a whole number, got {value!r}{hint}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise InvalidArgumentError(f"{name} must be at least {minimum}{upper}, got {value}{hint}")
    return int(value)


def check_seed(value, *, name: str = "--seed") -> int:
    """A seed every random generator here accepts (0 to 2**31 - 1)."""
    return check_count(value, name=name, minimum=0, maximum=MAX_SEED)


def check_learning_rate(value, *, name: str = "lr") -> float:
    """A finite, non-negative learning rate (0 freezes the weights)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{name} must be finite and at least 0, got {value!r}")
    return float(value)


def check_output_paths(outputs: Mapping[str, PathLike | None], *, inputs: Iterable[PathLike] = ()) -> None:
    """Refuse outputs that cannot be written atomically or would replace an input or each other.

    ``outputs`` maps the option that names a file (``"--json"``) to its path (None: not
    asked for). Each must be a file name (not a directory, not a device) in an existing,
    writable directory, and differ from every input and every other output.
    """
    inputs = [Path(p) for p in inputs if p is not None]
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        resolved = check_output_path(path, name=flag)
        for source in inputs:
            if _same_file(resolved, source):
                raise OutputPathError(f"{flag} {str(path)!r} would overwrite the input {str(source)!r}: write elsewhere")
        if resolved in seen:
            raise OutputPathError(f"{seen[resolved]} and {flag} both name {str(path)!r}: give each output its own file")
        seen[resolved] = flag


def check_output_path(path: PathLike, *, name: str) -> Path:
    """The resolved ``path`` if a file can be written there atomically (see :func:`check_output_paths`)."""
    text = os.fspath(path)
    if not text or text.endswith(os.sep) or Path(text).is_dir():
        raise OutputPathError(f"{name} {text!r} is a directory: give a file name")
    resolved = _resolve(text, name)
    if resolved.exists() and not resolved.is_file():
        raise OutputPathError(f"{name} {text!r} is not a regular file: give a file name")
    parent = resolved.parent
    if not parent.exists():
        raise OutputPathError(f"{name} {text!r}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{name} {text!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{name} {text!r}: directory {str(parent)!r} is not writable")
    if len(os.fsencode(resolved.name)) + _TEMP_NAME_EXTRA > _name_max(parent):
        raise OutputPathError(f"{name} {text!r}: the file name is too long")
    return resolved


def check_directory(path: PathLike, *, name: str, create: bool = True) -> Path:
    """``path`` as a directory that exists or (``create``) can be made, and is writable."""
    text = os.fspath(path)
    resolved = _resolve(text, name) if text else Path()
    if not text or (resolved.exists() and not resolved.is_dir()):
        raise OutputPathError(f"{name} {text!r} is not a directory: give a directory")
    existing = resolved
    while not existing.exists():
        if not create:
            raise OutputPathError(f"{name} {text!r} does not exist: create it first")
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{name} {text!r}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{name} {text!r}: directory {str(existing)!r} is not writable")
    return resolved


def _resolve(text: str, name: str) -> Path:
    if "\0" in text:
        raise OutputPathError(f"{name} {text!r}: a path cannot hold a NUL character")
    try:
        return Path(text).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise OutputPathError(f"{name} {text!r} cannot be resolved ({type(e).__name__}): give another path") from e


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
