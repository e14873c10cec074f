"""The export spinner: each phase on a terminal's stderr, nothing on a pipe or inside a caller's
own live display."""

from __future__ import annotations

import io
import logging
import sys

import torch

from ort_offload.export.progress import export_status, spinners_off
from ort_offload.export.training_step import export_training_step


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _export_tiny(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    return export_training_step(model, example_inputs=(x,), example_targets=(y,),
                                loss_fn=torch.nn.functional.mse_loss, name="tiny", cache_dir=tmp_path)


def test_a_terminal_sees_each_export_phase(tmp_path, monkeypatch, caplog):
    """The spinner redraws a dozen times a second, so a phase shorter than that may never be drawn
    (under load even the capture was missed once); the debug log hears every one."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.DEBUG, logger="ort_offload.export.progress"):
        assert not _export_tiny(tmp_path).cache_hit
    heard = [r.getMessage() for r in caplog.records if r.name == "ort_offload.export.progress"]
    assert heard == [f"exporting tiny (train): {phase}" for phase in (
        "capturing the model with torch.export", "building the joint forward/backward graph",
        "translating the joint graph to ONNX", "appending the AdamW update", "writing the export cache")]
    # Which phases get drawn depends on their length against the redraw rate; at least the last
    # one is drawn when the spinner stops, and only phases the log heard appear.
    drawn = [line for line in heard if line in terminal.getvalue()]
    assert drawn and "exporting tiny (train): " in terminal.getvalue()


def test_a_pipe_or_a_callers_live_display_sees_nothing(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with export_status("exporting") as phase:
        phase("a phase")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with spinners_off(), export_status("exporting") as phase:
        phase("a phase")
    assert pipe.getvalue() == terminal.getvalue() == ""
    with export_status("exporting") as phase:
        phase("a phase")
    assert "exporting: a phase" in terminal.getvalue()
