"""benchmarks/proto_mirror.py runs end to end on gpt tiny, writes its JSON and checks every write
against the full conversion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # ~30 s here with the export cached; the bound only stops a hung run


def test_writes_the_rows_and_the_table(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.proto_mirror", "--models", "gpt:tiny", "--repeats", "1",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "proto_mirror.json").read_text())
    (row,) = result["rows"]
    assert row["model"] == "gpt tiny" and row["writes"] > 0 and row["bytes_equal"]
    assert row["mirror_ms_per_write"] > 0 and row["full_ms_per_write"] > 0
    assert "full / mirror" in done.stdout


def test_bad_arguments_are_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.proto_mirror", "--models", "gpt", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "name:config" in done.stderr and not list(tmp_path.iterdir())
