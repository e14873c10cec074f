"""The export cache verifies every entry against the content hash written with it: a damaged,
emptied, truncated or edited entry gives a warning and a fresh export, never a wrong graph."""

from __future__ import annotations

import logging
import shutil

import onnx
import pytest

from models import get_model
from ort_offload.cli import main
from ort_offload.export.training_step import export_training_step
from ort_offload.export.cache import hash_path


def export_mlp(cache_dir):
    spec = get_model("mlp", "tiny")
    inputs, targets = spec.make_batch(seed=0)
    return export_training_step(spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
                                input_names=spec.input_names, target_names=spec.target_names,
                                dynamic_axes=spec.dynamic_axes, name="mlp", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A cache directory holding one verified mlp entry, and that export's result."""
    directory = tmp_path_factory.mktemp("pristine_cache")
    result = export_mlp(directory)
    assert result.path is not None and hash_path(result.path).exists()
    return directory, result


def initializers(model: onnx.ModelProto) -> dict[str, bytes]:
    return {t.name: t.SerializeToString() for t in model.graph.initializer}


def _edit_a_constant(data: bytes) -> bytes:
    """Change one byte inside the first float initializer's raw data (still a valid model)."""
    model = onnx.load_model_from_string(data)
    tensor = next(t for t in model.graph.initializer if t.raw_data)
    raw = bytearray(tensor.raw_data)
    raw[0] ^= 0x40
    tensor.raw_data = bytes(raw)
    return model.SerializeToString()


DAMAGE = {
    "emptied": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "cut_at_the_end": lambda data: data[:-3],
    "edited_constant": _edit_a_constant,
}


# Two damages in the fast suite (an emptied file, one edited constant); the other two read the
# same hash mismatch and run in test-all.
@pytest.mark.parametrize("damage", [d if d in ("emptied", "edited_constant") else pytest.param(d, marks=pytest.mark.slow)
                                    for d in sorted(DAMAGE)])
def test_a_damaged_entry_is_exported_again_with_a_warning(tmp_path, pristine, caplog, damage):
    source, original = pristine
    directory = tmp_path / "cache"
    shutil.copytree(source, directory)
    entry = directory / original.path.name
    entry.write_bytes(DAMAGE[damage](entry.read_bytes()))
    with caplog.at_level(logging.WARNING):
        result = export_mlp(directory)
    assert not result.cache_hit
    assert any("exporting again" in r.getMessage() for r in caplog.records)
    assert initializers(result.graph.model) == initializers(original.graph.model)
    assert result.graph.data_inputs == original.graph.data_inputs
    healed = export_mlp(directory)  # the fresh export replaced the entry and its hash
    assert healed.cache_hit and initializers(healed.graph.model) == initializers(original.graph.model)


def test_an_entry_without_its_hash_is_not_trusted(tmp_path, pristine, caplog):
    source, original = pristine
    directory = tmp_path / "cache"
    shutil.copytree(source, directory)
    hash_path(directory / original.path.name).unlink()
    with caplog.at_level(logging.WARNING):
        assert not export_mlp(directory).cache_hit
    assert any("content hash" in r.getMessage() for r in caplog.records)
    assert export_mlp(directory).cache_hit


def test_export_command_with_an_emptied_entry_writes_a_valid_graph(tmp_path, pristine, capsys):
    source, original = pristine
    directory = tmp_path / "cache"
    shutil.copytree(source, directory)
    (directory / original.path.name).write_bytes(b"")
    out = tmp_path / "mlp.onnx"
    assert main(["export", "--model", "mlp", "-o", str(out), "--cache-dir", str(directory)]) == 0
    onnx.checker.check_model(onnx.load(out))
    assert "inputs x, y" in capsys.readouterr().out
    assert (directory / original.path.name).stat().st_size > 0  # the entry the command used was healed


def test_a_damaged_block_step_entry_is_exported_again(tmp_path, caplog):
    import torch

    from ort_offload.dynamic.block_export import export_block_step

    block, args = torch.nn.Linear(4, 3), (torch.randn(2, 4),)
    first = export_block_step(block, args, cache_dir=tmp_path)
    entry = next(tmp_path.glob("block-*.onnx"))
    entry.write_bytes(entry.read_bytes()[:-5])
    with caplog.at_level(logging.WARNING):
        again = export_block_step(block, args, cache_dir=tmp_path)
    assert not again.cache_hit and any("exporting again" in r.getMessage() for r in caplog.records)
    assert len(again.model.graph.node) == len(first.model.graph.node)
    assert export_block_step(block, args, cache_dir=tmp_path).cache_hit


def test_entries_with_external_data_are_verified_file_by_file(tmp_path, caplog):
    import numpy as np
    import onnx.helper as oh
    from onnx import numpy_helper

    from graph_passes.ir.training_graph import TrainingGraph
    from ort_offload.export.cache import read_entry, write_entry

    weight = np.arange(4096, dtype=np.float32).reshape(64, 64)
    graph = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])],
                          initializer=[numpy_helper.from_array(weight, "w")])
    entry = tmp_path / "big.onnx"
    write_entry(entry, lambda p: TrainingGraph.from_model(oh.make_model(graph)).save(p, external_data_bytes=1000))
    data = entry.with_name("big.onnx.data")
    assert data.exists()
    np.testing.assert_array_equal(numpy_helper.to_array(read_entry(entry).graph.initializer[0]), weight)
    original = data.read_bytes()
    data.write_bytes(original[:-4] + b"\0\0\0\1")
    with caplog.at_level(logging.WARNING):
        assert read_entry(entry) is None
    data.unlink()
    assert read_entry(entry) is None
    assert sum("exporting again" in r.getMessage() for r in caplog.records) == 2
