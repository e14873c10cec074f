"""Stepping thread's CPU time per phase of a step (gpt tiny, unbudgeted), inclusive per wrapped call.

python benchmarks/results/2026-12-01/overhead4/phases.py [max_block_nodes|auto] [steps] [noop|flushK|sleepN]
'noop': every run_with_iobinding replaced by a no-op after warm-up (what only costs when ORT runs);
'flushK': the no-op writes K KiB of scratch memory instead (evicting the caches as kernels would).
"""
import collections, gc, statistics, sys, time
import onnxruntime; onnxruntime.set_default_logger_severity(3)
import ort_offload
from models import get_model
from ort_offload.export import optimizers

nodes = None if len(sys.argv) < 2 or sys.argv[1] == "auto" else int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
noop = len(sys.argv) > 3 and sys.argv[3] in ("noop",) or len(sys.argv) > 3 and sys.argv[3].startswith("flush")
import numpy as np
scratch = np.zeros(int(sys.argv[3][5:]) * 1024 if len(sys.argv) > 3 and sys.argv[3].startswith("flush") else 0, np.uint8)
# 'sleepN': sleep N µs after every ORT call, inside its timed window (outside figures stay clean)
after_s = float(sys.argv[3][5:]) * 1e-6 if len(sys.argv) > 3 and sys.argv[3].startswith("sleep") else 0.0
spec = get_model("gpt", "tiny")
inputs, targets = spec.make_batch(8, spec.default_seq)
import os
# ORT_THREADS=1: blocks run single-threaded; ORT_SPIN=0: no spinning pools (experiments only)
if os.environ.get("ORT_SPIN") == "0":
    from ort_offload.runtime import runner as _runner
    _options = _runner.Runtime.session_options
    _runner.Runtime.session_options = lambda self, *, spinning, serial=False: _options(self, spinning=False, serial=serial)
dev = ort_offload.set_offload_device("cpu", budget=None, max_block_nodes=nodes,
                                     intra_op_threads=int(os.environ.get("ORT_THREADS", "0")))
tr = ort_offload.create_ort_trainer(dev, spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
    input_names=list(spec.input_names), target_names=list(spec.target_names), dynamic_axes=spec.dynamic_axes,
    name="gpt-tiny", optimizer=optimizers.make_optimizer("adamw"))
batch = inputs + targets
for _ in range(5):
    tr.step(*batch)

import resource
faults = collections.defaultdict(int)  # label -> minor page faults of this thread (inclusive)
def minflt():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
acc = collections.defaultdict(int)   # label -> ns this step (inclusive)
calls = collections.defaultdict(int)
clock = time.thread_time_ns

def wrap(obj, attr, label, fn=None, pause=0.0):
    f = fn or getattr(obj, attr)
    def timed(*a, **k):
        m = minflt()
        c = clock()
        try:
            return f(*a, **k)
        finally:
            if pause:
                time.sleep(pause)
            acc[label] += clock() - c
            faults[label] += minflt() - m
            calls[label] += 1
    setattr(obj, attr, timed)

sessions = {id(v.session): v.session for s in tr.runner._sessions.values() for v in s._variants.values()}
for s in sessions.values():
    wrap(s, "run_with_iobinding", "ORT", (lambda b, *a: scratch.fill(1)) if noop else None, pause=after_s)
rt, runner, arena = tr.runtime, tr.runner, tr.runtime.arena
wrap(tr, "_feeds", "trainer._feeds")
wrap(tr, "_prepare", "trainer._prepare")
wrap(tr, "_check_finite", "trainer._check_finite")
wrap(rt, "write", "runtime.write(step)")
wrap(runner, "run", "runner.run")
wrap(runner.placed, "table", "placed.table")
wrap(runner.placed, "run", "placed.run")
wrap(runner.placed, "_run_block", "placed._run_block")
for s in {id(s): s for s in runner._sessions.values()}.values():
    wrap(s, "run_at", "session.run_at")
wrap(arena, "write_at", "arena.write_at")
wrap(arena, "read_at", "arena.read_at")
wrap(arena, "adopt", "arena.adopt")
wrap(arena.allocator, "restore", "allocator.restore")
wrap(arena, "cover", "arena.cover")
wrap(arena, "holds_all", "arena.holds_all")
wrap(arena, "set_capacity", "arena.set_capacity")
wrap(arena, "all_finite", "arena.all_finite")
gc_ns = [0, 0]
def gc_cb(phase, info, _t=[0]):
    if phase == "start": _t[0] = clock()
    else: gc_ns[0] += clock() - _t[0]; gc_ns[1] += 1
gc.callbacks.append(gc_cb)
# the wrapper's own cost: one wrapped no-op, timed the same way
def nothing(): pass
class O: pass
o = O(); o.f = nothing; wrap(o, "f", "_cal")
for _ in range(1000): o.f()
cal = acc.pop("_cal") / calls.pop("_cal")

rows = collections.defaultdict(list)
switches = []  # per step: (involuntary, voluntary) context switches of this thread
acc.clear(); calls.clear(); faults.clear()
gc.collect()
for _ in range(steps):
    acc.clear(); g0 = gc_ns[0]
    u0 = resource.getrusage(resource.RUSAGE_THREAD)
    m = minflt(); c = clock(); tr.step(*batch); total = clock() - c
    u1 = resource.getrusage(resource.RUSAGE_THREAD)
    switches.append((u1.ru_nivcsw - u0.ru_nivcsw, u1.ru_nvcsw - u0.ru_nvcsw))
    faults["step total"] += minflt() - m
    rows["step total"].append(total)
    rows["outside ORT"].append(total - acc["ORT"])
    rows["gc"].append(gc_ns[0] - g0)
    for k, v in acc.items():
        rows[k].append(v)
ncalls = {k: v / steps for k, v in calls.items()}
blocks = len(runner.last_prepared.program.blocks)
print(f"blocks={blocks} steps={steps} noop={noop} flush={scratch.size >> 10} KiB sleep after ORT={after_s*1e6:.0f} us wrapper cost ~{cal:.0f} ns/call (included in the figures)")
print(f"{'phase':24s} {'median us':>10s} {'mean us':>10s} {'calls/step':>10s} {'faults/step':>11s}")
for k, v in rows.items():
    print(f"{k:24s} {statistics.median(v)/1e3:10.1f} {statistics.fmean(v)/1e3:10.1f} {ncalls.get(k, 1):10.1f} {faults.get(k, 0) / steps:11.2f}")
print("gc collections during measured steps:", gc_ns[1], "loss", tr.losses[-1])
by_switches = collections.defaultdict(list)
for (inv, vol), outside in zip(switches, rows["outside ORT"]):
    by_switches[min(inv + vol, 8)].append(outside)
print("outside ORT by context switches of the stepping thread in the step (8 = 8 or more):")
for n in sorted(by_switches):
    v = by_switches[n]
    print(f"  {n} switches: {len(v):4d} steps, median {statistics.median(v)/1e3:7.1f} us")
