"""Human-readable sizes for log lines and messages (standard library only, at the bottom)."""

from __future__ import annotations


def format_bytes(nbytes: int | float | None) -> str:
    """Human-readable binary size, e.g. ``12.5 MiB``; None reads ``unlimited``."""
    if nbytes is None:
        return "unlimited"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
