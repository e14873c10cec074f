"""Atomic output files: a failed write leaves the old file and no temporary; temporaries of
dead writers are swept, those of live ones kept."""

from __future__ import annotations

import os

import pytest

from ort_offload.files import atomic_open, atomic_write_bytes, atomic_write_with, stale_temps, sweep_stale_temps


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = atomic_write_bytes(tmp_path / "r.json", b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(path) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed midway")
    with pytest.raises(RuntimeError):
        atomic_write_with(path, lambda tmp: (tmp.write_bytes(b"new"), (_ for _ in ()).throw(RuntimeError()))[0])
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_only_temporaries_of_dead_writers_of_the_same_file_are_swept(tmp_path):
    path = tmp_path / "p.png"
    dead, dead_figure = tmp_path / ".p.png.tmp4194999", tmp_path / ".p.tmp4194998.png"
    live = tmp_path / f".p.png.tmp{os.getppid()}"
    other = tmp_path / ".q.png.tmp4194999"  # another file's
    for p in (dead, dead_figure, live, other):
        p.write_bytes(b"partial")
    assert stale_temps(path) == sorted([dead, dead_figure])
    assert sorted(sweep_stale_temps(path)) == sorted([dead, dead_figure])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
