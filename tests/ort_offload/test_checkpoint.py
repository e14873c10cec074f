"""Checkpoints: every damaged or mismatched file is a CheckpointError raised before the trainer
changes, saves fail cleanly, and temporary files of killed saves are swept."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import train_ort
from ort_offload.checkpoint import CHECKPOINT_FORMAT, Checkpoint, read_checkpoint, write_checkpoint
from ort_offload.errors import CheckpointError, OffloadError
from ort_offload.files import stale_temps

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained():
    """An mlp trainer after 2 AdamW steps and its state (tests must leave it so)."""
    run = train_ort("mlp", steps=2, optimizer="adamw")
    return run.trainer, run.state


def craft(path: Path, meta, state: dict[str, np.ndarray], **extra) -> Path:
    """An .npz laid out like a checkpoint, with whatever metadata and state it is given."""
    entries = {f"state/{k}": v for k, v in state.items()}
    np.savez(path, __meta__=np.array(json.dumps(meta)), **entries, **extra)
    return path


def assert_unchanged(trainer, state, steps=2, losses=2):
    now = trainer.flat_state()
    assert [k for k in state if now[k].tobytes() != state[k].tobytes()] == []
    assert trainer.steps_done == steps and len(trainer.losses) == losses


def good_meta(**changes):
    return {"format": CHECKPOINT_FORMAT, "model": "mlp", "steps": 2, "losses": [1.0, 0.5], **changes}


@pytest.mark.parametrize("meta", [
    good_meta(steps="abc"),
    good_meta(steps=-1),
    good_meta(steps=True),
    good_meta(steps=1.5),
    good_meta(losses=5),
    good_meta(losses=["a"]),
    good_meta(model=7),
    good_meta(format="other.v9"),
    [1, 2, 3],
    "just a string",
    good_meta(steps=5),  # disagrees with optimizer.step
])
def test_bad_metadata_is_refused_before_the_state_changes(tmp_path, trained, meta):
    trainer, state = trained
    path = craft(tmp_path / "c.npz", meta, state)
    with pytest.raises(CheckpointError):
        trainer.load(path)
    assert_unchanged(trainer, state)


def test_damaged_files_are_checkpoint_errors(tmp_path, trained):
    trainer, state = trained
    good = trainer.save(tmp_path / "good.npz")
    data = good.read_bytes()
    cases = {
        "empty.npz": b"",
        "text.npz": b"not a checkpoint",
        "half.npz": data[: len(data) // 2],
        "tail.npz": data[:-10],
        "npy.npz": None,
    }
    for name, content in cases.items():
        path = tmp_path / name
        if content is None:
            np.save(path.with_suffix(".npy"), np.zeros(3))
            path.with_suffix(".npy").rename(path)
        else:
            path.write_bytes(content)
        with pytest.raises(CheckpointError):
            trainer.load(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        trainer.load(tmp_path / "missing.npz")
    with pytest.raises(CheckpointError, match="directory"):
        trainer.load(tmp_path)
    no_meta = tmp_path / "nometa.npz"
    np.savez(no_meta, **{f"state/{k}": v for k, v in state.items()})
    with pytest.raises(CheckpointError, match="metadata"):
        trainer.load(no_meta)
    with pytest.raises(CheckpointError, match="not state"):
        trainer.load(craft(tmp_path / "extra.npz", good_meta(), state, other=np.zeros(2)))
    assert_unchanged(trainer, state)


def test_non_finite_or_mismatched_tensors_are_refused(tmp_path, trained):
    trainer, state = trained
    name = next(k for k, v in state.items() if v.dtype == np.float32 and v.size > 1)
    for value in (np.nan, np.inf):
        bad = dict(state)
        bad[name] = state[name].copy()
        bad[name].flat[0] = value
        with pytest.raises(CheckpointError, match="non-finite"):
            trainer.load(craft(tmp_path / "nan.npz", good_meta(), bad))
        with pytest.raises(CheckpointError, match="non-finite"):
            trainer.load_flat_state(bad)
    wrong_dtype = {**state, name: state[name].astype(np.float64)}
    with pytest.raises(CheckpointError):
        trainer.load(craft(tmp_path / "dtype.npz", good_meta(), wrong_dtype))
    with pytest.raises(CheckpointError):
        trainer.load_flat_state({**state, "optimizer.step": np.array(np.nan, dtype=np.float32)})
    with pytest.raises(CheckpointError):
        trainer.load_flat_state({**state, "optimizer.step": np.array(0.5, dtype=np.float32)})
    with pytest.raises(CheckpointError):
        trainer.load_flat_state([1, 2])
    assert_unchanged(trainer, state)


def test_save_failures_are_checkpoint_errors_and_write_nothing(tmp_path, trained):
    trainer, state = trained
    with pytest.raises(CheckpointError):
        trainer.save(tmp_path / "nodir" / "c.npz")
    (tmp_path / "adir").mkdir()
    with pytest.raises(CheckpointError):
        trainer.save(tmp_path / "adir")
    with pytest.raises(CheckpointError, match="non-finite"):
        write_checkpoint(tmp_path / "nan.npz", Checkpoint("m", 0, [], {"w": np.array([np.nan], dtype=np.float32)}))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir"]
    assert issubclass(CheckpointError, OffloadError)


def test_non_finite_losses_round_trip_as_null(tmp_path):
    path = write_checkpoint(tmp_path / "c.npz", Checkpoint("m", 2, [1.0, float("nan")], {"w": np.ones(2, np.float32)}))
    with np.load(path) as data:
        assert json.loads(str(data["__meta__"]))["losses"] == [1.0, None]
    back = read_checkpoint(path)
    assert back.losses[0] == 1.0 and np.isnan(back.losses[1])


def test_temporary_files_of_dead_writers_are_swept_by_the_next_save_and_load(tmp_path, trained):
    trainer, state = trained
    path = tmp_path / "c.npz"
    dead = tmp_path / ".c.npz.tmp4194999"  # above any pid this machine hands out
    live = tmp_path / f".c.npz.tmp{os.getppid()}"  # a running process's save in progress
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    trainer.save(path)
    assert not dead.exists() and live.exists()
    dead.write_bytes(b"partial")
    trainer.load(path)
    assert not dead.exists() and live.exists()
    assert_unchanged(trainer, state)


_SAVER = """
import sys
import numpy as np
from ort_offload.checkpoint import Checkpoint, write_checkpoint
state = {f"w{i}": np.full((256, 256), i, dtype=np.float32) for i in range(8)}
path, steps = sys.argv[1], 0
print("ready", flush=True)
while True:
    steps += 1
    write_checkpoint(path, Checkpoint("kill-test", steps, [0.0] * (steps % 7), state))
"""


@pytest.mark.slow
def test_sigkill_during_save_never_breaks_the_checkpoint_and_leaves_no_temp(tmp_path):
    """25 SIGKILLs at random moments of a save loop: the file always reads, temps are swept."""
    path = tmp_path / "c.npz"
    write_checkpoint(path, Checkpoint("kill-test", 0, [], {"w0": np.zeros(1, np.float32)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    rng = random.Random(0)
    left_behind = 0
    for _ in range(25):
        child = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE, env=env)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        left_behind += len(stale_temps(path))
        checkpoint = read_checkpoint(path)  # never a partial file; this read also sweeps
        assert checkpoint.model == "kill-test"
        assert stale_temps(path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert left_behind > 0, "no kill landed inside a save: the test proves nothing"
