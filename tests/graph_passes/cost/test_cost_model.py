"""Cost model: FLOP and byte counts against hand-computed numbers, roofline bounds, transfer
times, shipped and measured device profiles, profiled block times with analytical fallback."""

import json
import math

import numpy as np
import onnx
import onnx.helper
import onnx.parser
import pytest

from graph_passes.ir import shapes
from graph_passes.cost.cost_model import (
    AnalyticalCostModel,
    NodeCost,
    NodeTimesOnce,
    ProfiledCostModel,
    TRANSCENDENTAL_FLOPS,
    is_compute_bound,
    node_bytes,
    node_cost,
    node_flops,
    profile_blocks,
    roofline_time,
    transfer_time,
)
from graph_passes.cost.device_profiles import (
    SHIPPED_PROFILES,
    DeviceProfile,
    cpu_model_name,
    get_profile,
    measure_cpu_profile,
    profile_cache_dir,
)
from graph_passes.ir.program import lower
from graph_passes.ir.shapes import TensorInfo

F32 = np.dtype(np.float32)


def graph_infos(text: str, **feed_shapes):
    """Parse a graph, feed zeros of the given shapes, infer every value's info."""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    declared = shapes.declared_inputs(model)
    feeds = {name: np.zeros(feed_shapes[name], dtype=declared[name][0]) for name in declared}
    return model, shapes.infer_tensor_infos(model, shapes.check_inputs(model, feeds))


def only_node(text, **feed_shapes):
    model, infos = graph_infos(text, **feed_shapes)
    return model, model.graph.node[-1], infos


HEADER = '<ir_version: 9, opset_import: ["" : 20]>\n'


def test_batched_matmul_flops_count_every_batch():
    model, node, infos = only_node(HEADER + """
        g (float[2, 3, 4, 5] a, float[5, 6] b) => (float[2, 3, 4, 6] y) { y = MatMul(a, b) }
    """, a=(2, 3, 4, 5), b=(5, 6))
    assert node_flops(node, infos) == 2 * (2 * 3) * 4 * 6 * 5  # 1440
    assert node_bytes(node, infos) == 4 * (2 * 3 * 4 * 5 + 5 * 6 + 2 * 3 * 4 * 6)
    # Broadcast batch dims on both sides: [3,1,4,5] @ [2,5,6] -> [3,2,4,6].
    model, node, infos = only_node(HEADER + """
        g (float[3, 1, 4, 5] a, float[2, 5, 6] b) => (float[3, 2, 4, 6] y) { y = MatMul(a, b) }
    """, a=(3, 1, 4, 5), b=(2, 5, 6))
    assert node_flops(node, infos) == 2 * 3 * 2 * 4 * 6 * 5


def test_gemm_flops_with_transpose_and_bias():
    model, node, infos = only_node(HEADER + """
        g (float[5, 4] a, float[5, 3] b, float[3] c) => (float[4, 3] y) { y = Gemm<transA = 1>(a, b, c) }
    """, a=(5, 4), b=(5, 3), c=(3,))
    assert infos["y"].shape == (4, 3)
    assert node_flops(node, infos) == 2 * 4 * 3 * 5 + 4 * 3  # M=4, N=3, K=5, plus the bias add
    model, node, infos = only_node(HEADER + """
        g (float[4, 5] a, float[5, 3] b) => (float[4, 3] y) { y = Gemm(a, b) }
    """, a=(4, 5), b=(5, 3))
    assert node_flops(node, infos) == 2 * 4 * 3 * 5


def test_conv_flops_with_groups_stride_and_bias():
    text = HEADER + """
        g (float[2, 4, 9, 9] x, float[6, 2, 3, 3] w, float[6] bias) => (float[2, 6, 4, 4] y) {
            y = Conv<group = 2, strides = [2, 2], kernel_shape = [3, 3]>(x, w, bias)
        }
    """
    model, node, infos = only_node(text, x=(2, 4, 9, 9), w=(6, 2, 3, 3), bias=(6,))
    assert infos["y"].shape == (2, 6, 4, 4)
    # 2 * N * Cout * prod(out) * Cin/groups * prod(kernel) + one add per output for the bias.
    assert node_flops(node, infos) == 2 * 2 * 6 * 16 * (4 // 2) * 9 + 2 * 6 * 16  # 6912 + 192
    assert node_bytes(node, infos) == 4 * (2 * 4 * 81 + 6 * 2 * 9 + 6 + 2 * 6 * 16)


def test_conv_transpose_counts_multiply_adds_per_input_element():
    model, node, infos = only_node(HEADER + """
        g (float[1, 4, 3, 3] x, float[4, 2, 3, 3] w) => (float[1, 2, 7, 7] y) {
            y = ConvTranspose<strides = [2, 2]>(x, w)
        }
    """, x=(1, 4, 3, 3), w=(4, 2, 3, 3))
    assert infos["y"].shape == (1, 2, 7, 7)
    assert node_flops(node, infos) == 2 * 1 * 4 * 9 * 2 * 9  # N * Cin * in-spatial * Cout/g * kernel


def test_einsum_flops():
    model, node, infos = only_node(HEADER + """
        g (float[2, 3, 4] a, float[2, 4, 5] b) => (float[2, 3, 5] y) { y = Einsum<equation = "bij,bjk->bik">(a, b) }
    """, a=(2, 3, 4), b=(2, 4, 5))
    assert node_flops(node, infos) == 2 * 2 * 3 * 5 * 4


def test_elementwise_and_transcendental_flops():
    model, infos = graph_infos(HEADER + """
        g (float[2, 3] x, float[3] b) => (float[2, 3] y) {
            s = Add(x, b)
            e = Exp(s)
            r = Relu(e)
            t = Sum(r, s, e)
            y = Sigmoid(t)
        }
    """, x=(2, 3), b=(3,))
    add, exp, relu, total, sigmoid = model.graph.node
    assert node_flops(add, infos) == 6
    assert node_bytes(add, infos) == 4 * (6 + 3 + 6)
    assert node_flops(exp, infos) == 6 * TRANSCENDENTAL_FLOPS
    assert node_flops(relu, infos) == 6
    assert node_flops(total, infos) == 6 * 2  # three inputs: two adds per element
    assert node_flops(sigmoid, infos) > 6 * TRANSCENDENTAL_FLOPS - 1


def test_reductions_and_normalisations_count_per_input_element():
    model, infos = graph_infos(HEADER + """
        g (float[4, 10] x, float[10] scale) => (float[4, 1] r, float[4, 10] n) {
            s = Softmax<axis = -1>(x)
            ax = Constant<value = int64[1] {1}>()
            r = ReduceSum<keepdims = 1>(s, ax)
            n = LayerNormalization<axis = -1>(s, scale)
        }
    """, x=(4, 10), scale=(10,))
    softmax, _, reduce_sum, norm = model.graph.node
    assert node_flops(reduce_sum, infos) == 40
    assert 2 * 40 <= node_flops(softmax, infos) <= 10 * 40
    assert 2 * 40 <= node_flops(norm, infos) <= 12 * 40


def test_data_movement_has_bytes_but_no_flops():
    model, infos = graph_infos(HEADER + """
        g (float[4, 6] x, float[100, 8] table, int64[5] idx) => (float[3, 8] y, float[5, 8] rows, float[8, 6] c) {
            t = Transpose<perm = [1, 0]>(x)
            shape = Constant<value = int64[2] {3, 8}>()
            y = Reshape(t, shape)
            rows = Gather<axis = 0>(table, idx)
            c = Concat<axis = 0>(x, x)
            sh = Shape(x)
        }
    """, x=(4, 6), table=(100, 8), idx=(5,))
    transpose, _, reshape, gather, concat, shape_node = model.graph.node
    for node in (transpose, reshape, gather, concat, shape_node):
        assert node_flops(node, infos) == 0
    assert node_bytes(transpose, infos) == 2 * 96
    assert node_bytes(reshape, infos) == 96 + 16 + 96
    assert node_bytes(gather, infos) == 160 + 40 + 160  # reads the rows it writes, not the table
    assert node_bytes(concat, infos) == 96 + 192  # x counted once
    assert node_bytes(shape_node, infos) == 16  # metadata only


def test_unknown_ops_cost_bytes_only_and_missing_infos_count_zero():
    node = onnx.helper.make_node("Mystery", ["a", "missing"], ["b"], domain="com.example")
    infos = {"a": TensorInfo(F32, (10, 10)), "b": TensorInfo(F32, (10,))}
    assert node_cost(node, infos) == NodeCost(0.0, 440)


def test_runtime_actions_and_constants_cost_no_time():
    node = onnx.helper.make_node("SwapOut", ["a"], ["b"], domain="ai.ort_offload")
    infos = {"a": TensorInfo(F32, (1000,)), "b": TensorInfo(F32, (1000,))}
    model = AnalyticalCostModel(get_profile("H100"))
    assert model.node_time(node, infos) == 0.0
    constant = onnx.helper.make_node("Constant", [], ["b"], value_float=1.0)
    assert model.node_time(constant, infos) == 0.0


PROFILE = DeviceProfile("test", peak_flops=1e12, memory_bandwidth=1e11, h2d_bandwidth=1e10,
                        d2h_bandwidth=8e9, duplex_bandwidth=1.2e10, device_memory_bytes=2**30,
                        kernel_launch_s=1e-6)


def test_roofline_picks_the_binding_resource():
    # Compute-bound: 1 GFLOP over 1 MB -> 1 ms of compute vs 10 µs of memory.
    assert roofline_time(1e9, 1e6, PROFILE) == pytest.approx(1e-3 + 1e-6)
    assert is_compute_bound(1e9, 1e6, PROFILE)
    # Memory-bound: 1 MFLOP over 1 GB -> 10 ms of memory traffic.
    assert roofline_time(1e6, 1e9, PROFILE) == pytest.approx(1e-2 + 1e-6)
    assert not is_compute_bound(1e6, 1e9, PROFILE)
    assert roofline_time(0, 0, PROFILE) == pytest.approx(1e-6)


def test_roofline_on_real_nodes():
    model, infos = graph_infos(HEADER + """
        g (float[512, 512] a, float[512, 512] b) => (float[512, 512] y) {
            m = MatMul(a, b)
            y = Add(m, a)
        }
    """, a=(512, 512), b=(512, 512))
    matmul, add = model.graph.node
    v100 = get_profile("V100-16GB-PCIe3")
    cost = node_cost(matmul, infos)
    assert is_compute_bound(cost.flops, cost.bytes, v100)
    assert AnalyticalCostModel(v100).node_time(matmul, infos) == pytest.approx(2 * 512**3 / 15.7e12 + v100.kernel_launch_s)
    cost = node_cost(add, infos)
    assert not is_compute_bound(cost.flops, cost.bytes, v100)
    assert AnalyticalCostModel(v100).node_time(add, infos) == pytest.approx(3 * 512 * 512 * 4 / 900e9 + v100.kernel_launch_s)


def test_transfer_time_one_way_and_duplex():
    assert transfer_time(1e9, PROFILE, "h2d") == pytest.approx(0.1)
    assert transfer_time(1e9, PROFILE, "d2h") == pytest.approx(1 / 8)
    assert transfer_time(1e9, PROFILE, "h2d", concurrent=True) == pytest.approx(1 / 6)  # 12 GB/s split
    assert transfer_time(1e9, PROFILE, "d2h", concurrent=True) == pytest.approx(1 / 6)
    assert transfer_time(0, PROFILE, "h2d") == 0.0
    v100 = get_profile("V100-16GB-PCIe3")
    assert transfer_time(12e9, v100, "h2d") == pytest.approx(1.0)
    assert transfer_time(10e9, v100, "d2h", concurrent=True) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="h2d"):
        transfer_time(1, PROFILE, "sideways")


def test_shipped_profiles():
    assert {"V100-16GB-PCIe3", "A100-80GB", "H100"} <= set(SHIPPED_PROFILES)
    v100 = get_profile("V100-16GB-PCIe3")
    assert (v100.h2d_bandwidth, v100.d2h_bandwidth, v100.duplex_bandwidth) == (12e9, 12e9, 20e9)
    assert v100.peak_flops == 15.7e12 and v100.memory_bandwidth == 900e9
    a100, h100 = get_profile("A100-80GB"), get_profile("H100")
    assert a100.peak_flops == 19.5e12 and h100.peak_flops == 67e12
    assert v100.memory_bandwidth < a100.memory_bandwidth < h100.memory_bandwidth
    assert v100.h2d_bandwidth < a100.h2d_bandwidth < h100.h2d_bandwidth
    for profile in SHIPPED_PROFILES.values():
        assert profile.duplex_bandwidth / 2 <= profile.h2d_bandwidth <= profile.duplex_bandwidth


def test_unknown_profile_name_lists_valid_names():
    with pytest.raises(ValueError, match="TPU-v9") as error:
        get_profile("TPU-v9")
    for name in ("cpu", "V100-16GB-PCIe3", "A100-80GB", "H100"):
        assert name in str(error.value)


def test_profile_rejects_nonsense():
    with pytest.raises(ValueError, match="peak_flops"):
        DeviceProfile("bad", 0, 1, 1, 1, 1, 1, 0)


SMALL = dict(matmul_n=64, copy_bytes=1 << 20, repeats=2)


def test_measure_cpu_profile_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_OFFLOAD_CACHE_DIR", str(tmp_path / "exports"))
    assert profile_cache_dir() == tmp_path / "profiles"
    profile = measure_cpu_profile(**SMALL)
    for field in ("peak_flops", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth", "duplex_bandwidth"):
        value = getattr(profile, field)
        assert math.isfinite(value) and value > 0, field
    assert profile.name == "cpu" and profile.device_memory_bytes > 0
    path = tmp_path / "profiles" / "cpu.json"
    cached = json.loads(path.read_text())
    assert cached[cpu_model_name()]["peak_flops"] == profile.peak_flops
    # The second call reads the file (doctor it to tell).
    cached[cpu_model_name()]["peak_flops"] = 123.0
    path.write_text(json.dumps(cached))
    assert get_profile("cpu", **SMALL).peak_flops == 123.0
    assert measure_cpu_profile(refresh=True, **SMALL).peak_flops != 123.0


def test_profile_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("ORT_OFFLOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert profile_cache_dir() == tmp_path / "ort_offload" / "profiles"


CHAIN = HEADER + """
    g (float[4, 8] x, float[8, 16] w, float[16] b) => (float[4, 16] y) {
        h = MatMul(x, w)
        z = Add(h, b)
        e = Exp(z)
        y = Relu(e)
    }
"""


def lowered_chain(max_block_nodes=2):
    model, infos = graph_infos(CHAIN, x=(4, 8), w=(8, 16), b=(16,))
    program = lower(model, infos, state_pairs={}, data_inputs=["x"], max_block_nodes=max_block_nodes)
    return model, infos, program


def test_analytical_block_time_is_the_sum_of_node_times():
    model, infos, program = lowered_chain()
    assert len(program.blocks) == 2
    analytical = AnalyticalCostModel(get_profile("A100-80GB"))
    for block in program.blocks:
        expected = sum(analytical.node_time(model.graph.node[i], infos) for i in block.node_indices)
        assert analytical.block_time(model, block, infos) == pytest.approx(expected)
    total = sum(analytical.node_time(n, infos) for n in model.graph.node)
    assert analytical.program_time(model, program, infos) == pytest.approx(total)


def test_node_times_once_gives_the_same_floats_and_asks_each_node_once():
    model, infos, program = lowered_chain()
    analytical = AnalyticalCostModel(get_profile("V100-16GB-PCIe3"))
    asked = []

    class Counting(AnalyticalCostModel):
        def node_time(self, node, infos):
            asked.append(node.name)
            return super().node_time(node, infos)

    once = NodeTimesOnce(Counting(analytical.profile), model, infos)
    finest = lowered_chain(max_block_nodes=1)[2]
    for blocks in (program.blocks, finest.blocks, program.blocks):
        for block in blocks:
            assert once.block_time(model, block, infos) == analytical.block_time(model, block, infos)  # bitwise
    assert sorted(asked) == sorted(n.name for n in model.graph.node)
    other = dict(infos)  # other shapes: not from the memo
    once.block_time(model, program.blocks[0], other)
    assert len(asked) == len(model.graph.node) + len(program.blocks[0].node_indices)
    with pytest.raises(TypeError, match="its own way"):
        NodeTimesOnce(ProfiledCostModel({}, analytical.profile), model, infos)


def test_profiled_model_uses_measurements_and_falls_back():
    model, infos, program = lowered_chain()
    first, second = program.blocks
    h100 = get_profile("H100")
    profiled = ProfiledCostModel({first.node_indices: 0.25}, h100)
    assert profiled.is_measured(first) and not profiled.is_measured(second)
    assert profiled.block_time(model, first, infos) == 0.25
    assert profiled.block_time(model, second, infos) == pytest.approx(AnalyticalCostModel(h100).block_time(model, second, infos))
    assert profiled.program_time(model, program, infos) == pytest.approx(0.25 + AnalyticalCostModel(h100).block_time(model, second, infos))
    with pytest.raises(ValueError):
        ProfiledCostModel({(0,): -1.0}, h100)


def test_profile_blocks_takes_the_median_of_repeats():
    model, infos, program = lowered_chain()
    now = [0.0]
    durations = {program.blocks[0].index: iter([9.0, 3.0, 1.0, 2.0]), program.blocks[1].index: iter([9.0, 5.0, 7.0, 6.0])}
    calls = []

    def run_block(block):
        calls.append(block.index)
        now[0] += next(durations[block.index])

    measured = profile_blocks(program, run_block, repeats=3, warmup=1, clock=lambda: now[0])
    assert calls == [0, 0, 0, 0, 1, 1, 1, 1]
    assert measured == {program.blocks[0].node_indices: 2.0, program.blocks[1].node_indices: 6.0}
    profiled = ProfiledCostModel(measured, PROFILE)
    assert profiled.block_time(model, program.blocks[1], infos) == 6.0
