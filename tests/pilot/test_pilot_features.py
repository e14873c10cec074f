"""Idiom table, operator signatures, AFM and sample features of the pilot."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest
import torch

from pilot.features import (
    AFM_SUMMARY_SIZE, POSITION_SLOTS, SAMPLE_FEATURE_SIZE, BlockGraph, afm_summary, architecture_feature_matrix,
    feature_size, network_type_one_hot, profile_block, sample_features,
)
from pilot.idioms import IDIOM_TABLE, IDIOMS, UnknownOpError, idiom_counts, op_signature
from pilot_helpers import FAMILIES, block_graphs, spec_and_architecture


# The families whose block exports take ~20 s each run in the slow suite.
SLOW_EXPORTS = {"tree-lstm", "recycle-former", "var-bert"}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_EXPORTS else f for f in FAMILIES])
def test_idiom_table_covers_every_op_of_the_zoo_blocks(family):
    ops = {node.op_type for g in block_graphs(family) for node in g.forward.graph.node}
    assert ops, "a block graph with no ops"
    missing = sorted(ops - set(IDIOM_TABLE))
    assert not missing, f"ops without an idiom entry: {missing}"


def test_every_entry_has_a_reason_and_six_counts():
    for op, entry in IDIOM_TABLE.items():
        assert len(entry.counts) == len(IDIOMS) and all(c >= 0 for c in entry.counts), op
        assert entry.reason.strip(), op


def test_matmul_signature_is_the_papers_example():
    # Fig. 3: a [ar, ac] @ b [br, bc] -> [1,0,0,1,1,0, ar+br, ac+bc, 0]
    sig = op_signature("MatMul", [(3, 5), (5, 7)])
    np.testing.assert_array_equal(sig, [1, 0, 0, 1, 1, 0, 8, 12, 0])
    assert idiom_counts("Gemm", {"transB": 1})[0] == idiom_counts("Gemm")[0] + 1
    with pytest.raises(UnknownOpError, match="NoSuchOp"):
        op_signature("NoSuchOp", [])


def test_profile_of_a_parsed_graph_counts_ops_dims_and_saved_bytes():
    model = onnx.parser.parse_model("""
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[2, 3] a, float[3, 4] b) => (float[2, 4] y, float[2, 4] s) {
            s = MatMul(a, b)
            y = Relu(s)
        }""")
    profile = profile_block(BlockGraph(model, ("s",), param_bytes=48))
    assert profile.op_types == ("MatMul", "Relu")
    np.testing.assert_array_equal(profile.vector, [2, 1, 0, 0, 1, 2, 0, 7, 11, 0])
    assert profile.saved_bytes == 2 * 4 * 4 and profile.param_bytes == 48
    afm = architecture_feature_matrix([profile, profile])
    assert afm.shape == (1 + 2 * 3, 9) and (~afm.any(axis=1)).sum() == 3  # control rows
    assert afm_summary([profile], 1000).shape == (AFM_SUMMARY_SIZE,)


def test_sample_features_keep_length_and_marker_counts():
    spec, arch = spec_and_architecture("var-bert")
    assert arch.one_hot.tolist() == network_type_one_hot("transformer").tolist()
    features = {}
    for key in (1, 4):
        (ids,), _ = spec.make_batch(1, seed=3, key=key)
        features[key] = sample_features(spec.model, ids)
        assert features[key].shape == (SAMPLE_FEATURE_SIZE,)
    assert not np.allclose(features[1], features[4])
    lstm, _ = spec_and_architecture("var-lstm")
    short, long = (sample_features(lstm.model, lstm.make_batch(1, seed=0, key=k)[0][0]) for k in (4, 12))
    assert long[0] > short[0]  # log1p(S)
    assert feature_size() == AFM_SUMMARY_SIZE + 3 + SAMPLE_FEATURE_SIZE
    # a batch sharing one path gives the mean of its rows' features
    (ids,), _ = spec.make_batch(4, seed=5, key=2)
    rows = np.mean([sample_features(spec.model, ids[i : i + 1]) for i in range(4)], axis=0)
    np.testing.assert_allclose(sample_features(spec.model, ids), rows, rtol=1e-5, atol=1e-5)


def test_repeat_offsets_say_how_far_back_each_token_last_occurred():
    spec, _ = spec_and_architecture("tree-lstm")
    open_, close = spec.config.vocab - 2, spec.config.vocab - 1
    ids = torch.tensor([[open_, open_, 1, 2, close, 3, close]])  # ( ( a b ) c )
    offsets = sample_features(spec.model, ids)[-POSITION_SLOTS:]
    expected = np.zeros(POSITION_SLOTS)
    expected[1] = 1 / POSITION_SLOTS  # the second OPEN, one back
    expected[6] = 2 / POSITION_SLOTS  # the second CLOSE, two back
    np.testing.assert_allclose(offsets, expected)
    # same brackets, other words: the same offsets (what repeats, not which token)
    other = torch.tensor([[open_, open_, 7, 9, close, 11, close]])
    np.testing.assert_allclose(sample_features(spec.model, other)[-POSITION_SLOTS:], expected)
    # another tree shape, other offsets: ( a ( b c ) ) puts the CLOSEs one apart
    right = torch.tensor([[open_, 1, open_, 2, 3, close, close]])
    assert not np.allclose(sample_features(spec.model, right)[-POSITION_SLOTS:], expected)


def test_trace_records_the_path_and_round_trips_as_json():
    from pilot.traces import Trace, median_block_times, record_trace

    spec, arch = spec_and_architecture("tree-lstm")
    (ids,), _ = spec.make_batch(2, seed=11)
    trace = record_trace(spec.name, spec.model, (ids,), arch.profiles)
    assert trace.path == tuple(spec.model.path(ids))
    assert all(i.time_s > 0 and i.ops == len(arch.profiles[i.block].op_types) for i in trace.invocations)
    assert Trace.from_json(trace.to_json()) == trace
    times = median_block_times([trace], arch.profiles)
    assert len(times) == len(arch.profiles) and all(t > 0 for t in times)


def test_pilot_package_does_not_import_the_runtime():
    import pathlib
    import re

    import pilot

    root = pathlib.Path(pilot.__file__).parent
    offenders = [p.name for p in root.glob("*.py") if re.search(r"^\s*(from|import)\s+ort_offload", p.read_text(), re.M)]
    assert offenders == []
