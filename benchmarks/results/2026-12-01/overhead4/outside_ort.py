"""Median CPU time of the stepping thread outside ONNX Runtime calls per step (gpt tiny, unbudgeted).

python benchmarks/results/2026-12-01/overhead4/outside_ort.py [max_block_nodes|auto] [steps] [tag]
Only run_with_iobinding is wrapped (one thread_time pair per block), after 6 warm-up steps.
"""
import gc, statistics, sys, time
import onnxruntime; onnxruntime.set_default_logger_severity(3)
import ort_offload
from models import get_model
from ort_offload.export import optimizers

nodes = None if sys.argv[1] == "auto" else int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
tag = sys.argv[3] if len(sys.argv) > 3 else ""
spec = get_model("gpt", "tiny")
inputs, targets = spec.make_batch(8, spec.default_seq)
dev = ort_offload.set_offload_device("cpu", budget=None, max_block_nodes=nodes)
tr = ort_offload.create_ort_trainer(dev, spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
    input_names=list(spec.input_names), target_names=list(spec.target_names), dynamic_axes=spec.dynamic_axes,
    name="gpt-tiny", optimizer=optimizers.make_optimizer("adamw"))
batch = inputs + targets
for _ in range(6):
    tr.step(*batch)
clock, ort_cpu = time.thread_time_ns, [0]
for s in {id(v.session): v.session for b in tr.runner._sessions.values() for v in b._variants.values()}.values():
    def timed(b, *a, _run=s.run_with_iobinding):
        c = clock()
        try:
            return _run(b, *a)
        finally:
            ort_cpu[0] += clock() - c
    s.run_with_iobinding = timed
outside, walls = [], []
gc.collect()
for _ in range(steps):
    o0, w, c = ort_cpu[0], time.perf_counter_ns(), clock()
    tr.step(*batch)
    outside.append(clock() - c - (ort_cpu[0] - o0))
    walls.append(time.perf_counter_ns() - w)
report = tr.report()
print(f"{tag} blocks={len(tr.runner.last_prepared.program.blocks)} outside-ORT CPU median {statistics.median(outside) / 1e3:6.1f} us "
      f"(quartiles {statistics.quantiles(outside)[0] / 1e3:.1f}-{statistics.quantiles(outside)[2] / 1e3:.1f}) "
      f"step wall {statistics.median(walls) / 1e6:.3f} ms peak {report['peak_device_bytes']} loss {tr.losses[-1]!r}")
