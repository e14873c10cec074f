"""What every benchmark shares: timing helpers, machine information, atomic JSON output and
the command-line frame (run, write ``benchmarks/results/<date>/NAME.json``, print the table)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def step_counts(args, changes: dict) -> None:
    """Apply the shared ``--steps``/``--warmup`` options to a settings change set, checked."""
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit("--steps must be at least 1")
        changes["measured_steps"] = args.steps
    if args.warmup is not None:
        if args.warmup < 1:
            raise SystemExit("--warmup must be at least 1 (the first step creates the sessions)")
        changes["warmup_steps"] = args.warmup


def bitwise_equal(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two loss sequences are the same floats, bit for bit."""
    return len(a) == len(b) and np.asarray(a, dtype=np.float64).tobytes() == np.asarray(b, dtype=np.float64).tobytes()


def state_mismatches(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> list[str]:
    """Names of state tensors that differ in any bit (or are missing) from the reference."""
    bad = [n for n in reference if n not in state or state[n].dtype != reference[n].dtype
           or state[n].shape != reference[n].shape or state[n].tobytes() != reference[n].tobytes()]
    return sorted(bad + [n for n in state if n not in reference])


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def machine_info() -> dict[str, Any]:
    import onnx
    import onnxruntime
    import torch

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            info["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def results_dir(out: Path | None) -> Path:
    """``out``, or the default ``benchmarks/results/<YYYY-MM-DD>``."""
    return Path(out) if out is not None else RESULTS_DIR / datetime.date.today().isoformat()


def write_json_atomic(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def run_main(
    *,
    module: str,
    result_file: str,
    argv: Sequence[str] | None,
    out: Path | None,
    table_width: int,
    measure: Callable[[Callable[[str], None]], dict[str, Any]],
    print_table: Callable[[dict[str, Any], Any], None],
    extra_outputs: Callable[[dict[str, Any], Path], Sequence[Path]] | None = None,
) -> int:
    """Measure (logging to stderr), write the JSON atomically, print the table.

    ``extra_outputs(result, out_dir)``, if given, writes further files next to the JSON (after
    it, each atomically) and returns their paths."""
    from rich.console import Console

    width = max(shutil.get_terminal_size((table_width, 24)).columns, table_width)
    console = Console(width=width)
    err = Console(stderr=True, width=width)
    out_dir = results_dir(out)
    if out_dir.exists() and not out_dir.is_dir():  # found now, not after the measuring
        print(f"error: --out {out_dir} is a file; give a directory for {result_file}", file=sys.stderr)
        return 2
    result = {
        "command": shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(),
    }
    result.update(measure(lambda msg: err.print(f"[dim]{msg}[/]")))
    if hasattr(os, "getloadavg"):
        result["machine"]["load_average_end"] = list(os.getloadavg())
    path = write_json_atomic(Path(out_dir) / result_file, result)
    extra = list(extra_outputs(result, Path(out_dir))) if extra_outputs is not None else []
    print_table(result, console)
    for written in (path, *extra):
        console.print(f"wrote {written}")
    return 0
