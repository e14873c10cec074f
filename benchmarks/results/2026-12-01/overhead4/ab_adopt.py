"""A/B in one process (on the after commit): DeviceArena.adopt copying placements and infos, as the before
commit did, vs sharing them, alternating every two steps (both tables of the cycle).

python benchmarks/results/2026-12-01/overhead4/ab_adopt.py [max_block_nodes|auto] [steps]
"""
import statistics, sys, time, gc
import onnxruntime; onnxruntime.set_default_logger_severity(3)
import ort_offload
from models import get_model
from ort_offload.export import optimizers
nodes = None if sys.argv[1] == "auto" else int(sys.argv[1]); steps = int(sys.argv[2])
spec = get_model("gpt", "tiny")
inputs, targets = spec.make_batch(8, spec.default_seq)
dev = ort_offload.set_offload_device("cpu", budget=None, max_block_nodes=nodes)
tr = ort_offload.create_ort_trainer(dev, spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
    input_names=list(spec.input_names), target_names=list(spec.target_names), dynamic_axes=spec.dynamic_axes,
    name="gpt-tiny", optimizer=optimizers.make_optimizer("adamw"))
batch = inputs + targets
for _ in range(6): tr.step(*batch)
arena = tr.runtime.arena
al = arena.allocator
def restore_copy(other):
    al._starts, al._sizes = list(other._starts), list(other._sizes); al._top = other._top
    al._placements = dict(other._placements); al._shared = False
    al.in_use = other.in_use; al.high_water = max(al.high_water, other.high_water); al.peak_in_use = max(al.peak_in_use, other.peak_in_use)
def adopt_copy(placed, infos, token, *, capacity):
    restore_copy(placed)
    if capacity is not None: al.capacity = capacity
    arena._infos = dict(infos); arena._token = token
def adopt_share(placed, infos, token, *, capacity):
    al.restore(placed)
    if capacity is not None: al.capacity = capacity
    arena._infos = infos; arena._token = token
ort_cpu = [0]
clock = time.thread_time_ns
for s in {id(v.session): v.session for b in tr.runner._sessions.values() for v in b._variants.values()}.values():
    run = s.run_with_iobinding
    def timed(b, *a, _run=run):
        c = clock()
        try: return _run(b, *a)
        finally: ort_cpu[0] += clock() - c
    s.run_with_iobinding = timed
res = {"copy": [], "share": []}
gc.collect()
for i in range(steps):
    mode = "copy" if (i // 2) % 2 == 0 else "share"  # pairs of steps: both tables of the cycle
    arena.adopt = adopt_copy if mode == "copy" else adopt_share
    o0 = ort_cpu[0]; c = clock(); tr.step(*batch); t = clock() - c
    res[mode].append(t - (ort_cpu[0] - o0))
for k, v in res.items():
    print(f"{k:6s} outside-ORT CPU median {statistics.median(v)/1e3:6.1f} us  mean {statistics.fmean(v)/1e3:6.1f}  n={len(v)}")
print("loss", tr.losses[-1])
