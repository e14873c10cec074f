"""What an export is doing, shown as a spinner on the terminal.

Exporting a step takes seconds to minutes (torch.export, the joint graph, the ONNX export), so a
person at a terminal sees which phase runs. Only when stderr is a terminal: pipes, logs and tests
see nothing. Callers that draw their own live display (a progress bar) turn spinners off around
it, so that two displays never fight over the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable, Iterator

logger = logging.getLogger(__name__)
_suppressed = 0


@contextlib.contextmanager
def spinners_off() -> Iterator[None]:
    """No export spinner inside this block (the caller draws its own live display)."""
    global _suppressed
    _suppressed += 1
    try:
        yield
    finally:
        _suppressed -= 1


@contextlib.contextmanager
def export_status(what: str) -> Iterator[Callable[[str], None]]:
    """A spinner reading ``what`` while the block runs; the block calls the yielded function with
    each phase it enters. Phases are also logged at debug level, terminal or not."""

    def log_phase(phase: str) -> None:
        logger.debug("%s: %s", what, phase)

    if _suppressed or not sys.stderr.isatty():
        yield log_phase
        return
    from rich.console import Console

    with Console(stderr=True).status(what) as status:

        def show_phase(phase: str) -> None:
            log_phase(phase)
            status.update(f"{what}: {phase}")

        yield show_phase
