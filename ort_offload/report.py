"""The run report: one set of keys for ``OrtTrainer.report()`` and every CLI ``--json``,
its rendering as a table, and the device-memory timeline plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ort_offload.budget import format_bytes
from ort_offload.files import atomic_write_bytes, atomic_write_with

REPORT_KEYS = (
    "model",
    "device",
    "budget_bytes",
    "baseline_peak_bytes",
    "peak_device_bytes",
    "within_budget",
    "steps",
    "losses",
    "swap_out_bytes",
    "swap_in_bytes",
    "recomputed_nodes",
    "split_nodes",
    "faults",
    "prefetch_hits",
    "step_time_s_median",
    "plan_time_s",
    "passes",
    "stall_time_s",  # extension: compute time lost waiting for copies (swap-ins, swap-outs freeing room, faults)
    "plans_made",  # extension: input signatures planned (a new shape is planned once)
    "plan_cache_hits",  # extension: steps whose signature had a plan already
    "recompute_plans",  # extension: recompute plans made (input sizes no cached plan fitted)
    "recompute_plan_reuses",  # extension: new input sizes served by the plan of a similar size
    "recompute_plan_time_s_median",  # extension: choosing segments, per plan made (estimator + bucket rule)
    "nonfinite_steps",  # extension: steps whose loss or updated state held NaN or inf
    "accounted_peak_bytes",  # extension: arena extent + running block's workspace, as plans count them
    "device_overhead_bytes",  # extension: device memory taken before the first tensor (CUDA context, handles); None on the CPU
    "budget_resolved_against",  # extension: a fraction budget's basis: {source, shapes, peak_bytes}; None for bytes
    "split_exact",  # extension: every split merges by Concat (bitwise equal); False: one sums partials; None: no split
)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a text file so that readers see the old file or the whole new one, never a part."""
    return atomic_write_bytes(path, text.encode())


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) as ``None``: strict JSON has no NaN."""
    if isinstance(value, float) or (isinstance(value, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def to_json(report: Mapping[str, Any]) -> str:
    """The report as strict JSON text (non-finite numbers as ``null``)."""
    return json.dumps(json_safe(dict(report)), indent=2, allow_nan=False, default=_number_or_text) + "\n"


def _number_or_text(value: Any) -> Any:
    """JSON for an object json does not know: its number (e.g. a 0-d tensor) if it has one, else its text."""
    try:
        return json_safe(float(value))
    except (TypeError, ValueError):
        return str(value)


def write_json(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    return atomic_write_text(path, to_json(report))


def render_table(report: Mapping[str, Any], extra: Mapping[str, Any] | None = None):
    """A rich Table of the report (bytes human-readable, losses summarised)."""
    from rich.table import Table

    table = Table(title=f"ort_offload report: {report['model']}", show_header=True)
    table.add_column("key", style="bold")
    table.add_column("value")
    rows = dict(report)
    rows.update(extra or {})
    for key, value in rows.items():
        table.add_row(key, _format_value(key, value))
    return table


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return f"{format_bytes(value)} ({int(value)})"
    if key == "losses" and isinstance(value, Sequence) and value:
        shown = ", ".join(f"{v:.6g}" for v in value[:3])
        if len(value) > 3:
            shown += f", ..., {value[-1]:.6g}"
        return f"[{shown}] ({len(value)})"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _progress(count: int) -> list[float]:
    return [i / max(count - 1, 1) for i in range(count)]


def plot_timeline(
    path: str | os.PathLike,
    *,
    baseline,
    planned=None,
    budget_bytes: int | None,
    title: str,
) -> Path:
    """PNG of device bytes over one step: baseline and planned timelines and the budget line.

    ``baseline``/``planned`` are :class:`graph_passes.ir.memory.MemoryTrace` objects; each point is
    arena bytes in use plus the workspace of the block running then.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for trace, label, style in ((baseline, "unplanned", "-"), (planned, "planned", "--")):
        if trace is None:
            continue
        ys = [(p.in_use + p.workspace) / 2**20 for p in trace.timeline]
        ax.step(_progress(len(ys)), ys, style, where="post", label=f"{label} (peak {format_bytes(trace.peak_device_bytes)})")
    if planned is not None:
        # Mark where the planned program copies tensors back in (swap-outs free memory in between).
        xs = _progress(len(planned.timeline))
        swap_ins = [(xs[i], (p.in_use + p.workspace) / 2**20) for i, p in enumerate(planned.timeline) if p.label.startswith("swap in")]
        if swap_ins:
            ax.scatter(*zip(*swap_ins), marker="^", s=12, color="tab:green", label="swap in", zorder=3)
    if budget_bytes is not None:
        ax.axhline(budget_bytes / 2**20, color="red", linewidth=1, label=f"budget {format_bytes(budget_bytes)}")
    ax.set_xlabel("progress through the step (programs differ in length: each is scaled to 0..1)")
    ax.set_ylabel("device MiB")
    ax.set_title(title)
    ax.legend(loc="best")
    return save_figure(fig, path)


def save_figure(fig, path) -> Path:
    """Write ``fig`` as a PNG atomically (a temporary file renamed into place) and close it."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, dpi=100), suffix=".png")
    finally:
        plt.close(fig)
