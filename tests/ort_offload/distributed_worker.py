"""One data-parallel rank for tests/test_distributed.py, started as torchrun would start it.

The environment holds RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. The rank trains gpt tiny
on global batches through ``create_ort_trainer`` (which picks up the default group) and writes
``rank<R>.json`` (losses, report, or the error) and ``rank<R>.npz`` (its state) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

GLOBAL_BATCH = 8


def gpt_batches(steps: int):
    """The global batches every test run trains on (gpt tiny, seeded per step)."""
    from models import get_model

    spec = get_model("gpt", "tiny")
    return spec, [spec.make_batch(GLOBAL_BATCH, None, seed=step) for step in range(steps)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--rank-budget", default=None, help="RANK=BUDGET: this rank starts with another budget")
    parser.add_argument("--save-after", type=int, default=0, help="save a checkpoint after this step")
    parser.add_argument("--die-at", type=int, default=0, help="rank 1 exits abruptly before this step")
    parser.add_argument("--block-nodes", type=int, default=None, help="the device's max_block_nodes")
    parser.add_argument("--shard", action="store_true", help="shard_optimizer_state=True")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout (covers rank 0's export)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    out = Path(args.out)
    import ort_offload
    from ort_offload.errors import OffloadError

    budget = args.budget
    if args.rank_budget and int(args.rank_budget.split("=")[0]) == rank:
        budget = args.rank_budget.split("=", 1)[1]
    spec, batches = gpt_batches(args.steps)
    record: dict = {"rank": rank}
    try:
        device = ort_offload.set_offload_device("cpu", budget=budget, intra_op_threads=1,
                                                max_block_nodes=args.block_nodes)
        inputs, targets = batches[0]
        trainer = ort_offload.create_ort_trainer(
            device, spec.model, loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets,
            input_names=spec.input_names, target_names=spec.target_names, name=spec.name, passes="auto",
            shard_optimizer_state=args.shard,
        )
        digests = []  # of the whole state after every step
        for number, (inputs, targets) in enumerate(batches, start=1):
            if number == args.die_at and rank == 1:
                os._exit(3)
            trainer.step(*inputs, *targets)
            state = trainer.flat_state()
            digests.append(hashlib.sha256(b"".join(state[n].tobytes() for n in sorted(state))).hexdigest())
            if number == args.save_after:
                trainer.save(out / "checkpoint.npz")
        np.savez(out / f"rank{rank}.npz", **trainer.flat_state())
        record.update(losses=trainer.losses, report=trainer.report(), digests=digests)
        code = 0
    except OffloadError as e:
        record.update(error=f"{type(e).__name__}: {e}")
        code = 2
    (out / f"rank{rank}.json").write_text(json.dumps(record, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
