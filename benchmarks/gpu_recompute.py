"""What recomputation costs on a real accelerator: BERT step time with and without every encoder
layer recomputed, per sequence length (context for the Mimose benchmark, issue 4).

``benchmarks/mimose.py`` measures recompute plans on this 2-core CPU, where the static
worst-case plan runs within a few percent of the graph with nothing recomputed, so no recompute
plan can be much faster than it there; it also replays each plan on GPU profiles in the
simulator. This script measures the quantity that decides Mimose's gain on real hardware: the
step-time cost of recomputing the layers, at each sequence length. It imports only torch, the
standard library and ``models/`` (pure torch), so it runs on the CUDA machine as it is::

    python3 benchmarks/gpu_recompute.py --out gpu_recompute.json            # CUDA
    python -m benchmarks.gpu_recompute --device cpu --config tiny --out x.json  # a smoke run

Per length: the same model and batch trained with AdamW (a) plainly, (b) with every encoder layer
under ``torch.utils.checkpoint`` (non-reentrant: the layer's forward re-runs in the backward),
which is what the static plan does at every length. Median step time over ``--repeats`` steps
after warm-up (CUDA-synchronised), and the peak allocated memory of each. The ratio (b)/(a) is
the most any input-aware plan could save at that length (it recomputes at most as much).
The two trainers start from the same weights; their first losses must agree (rel. 1e-6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # models/, when run as a script

LENGTHS = (32, 64, 128, 192, 256)


class SwitchableRecompute:
    """Wraps each of ``model.layers`` so that the layers in :attr:`recomputed` run under
    ``torch.utils.checkpoint`` and the rest plainly; the model's own forward is unchanged."""

    def __init__(self, torch, model) -> None:
        from torch.utils.checkpoint import checkpoint

        self.recomputed: frozenset[int] = frozenset()
        owner = self

        class Layer(torch.nn.Module):
            def __init__(self, index: int, layer):
                super().__init__()
                self.index = index
                self.layer = layer

            def forward(self, x):
                if self.index in owner.recomputed:
                    return checkpoint(self.layer, x, use_reentrant=False)
                return self.layer(x)

        model.layers = torch.nn.ModuleList(Layer(k, layer) for k, layer in enumerate(model.layers))
        self.layers = len(model.layers)


def _recompute_layers(torch, model) -> None:
    """Put every one of ``model.layers`` under ``torch.utils.checkpoint`` (its forward re-runs
    in the backward); the model's own forward is unchanged."""
    SwitchableRecompute(torch, model).recomputed = frozenset(range(len(model.layers)))


def _step_fn(torch, model, loss_fn, ids, y):
    """One AdamW training step of ``model`` on ``(ids, y)``, returning the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(ids), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _median_s(torch, step, device, repeats: int, warmup: int) -> tuple[float, float]:
    losses = [step() for _ in range(warmup)]
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), float(losses[0])


def measure(config: str, device_name: str, lengths: Sequence[int], repeats: int, warmup: int,
            batch: int | None = None) -> dict[str, Any]:
    import copy

    import torch

    from models import get_model

    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_recompute: no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32, as the shipped profiles
    spec = get_model("bert", config)
    rows = []
    for length in lengths:
        (ids,), (y,) = spec.make_batch(batch, seq=length, seed=length)
        ids, y = ids.to(device), y.to(device)
        row: dict[str, Any] = {"length": length}
        for label, recompute in (("plain", False), ("recompute_all", True)):
            torch.manual_seed(0)
            model = copy.deepcopy(spec.model).to(device)
            if recompute:
                _recompute_layers(torch, model)
            step = _step_fn(torch, model, spec.loss_fn, ids, y)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, first_loss = _median_s(torch, step, device, repeats, warmup)
            row[label] = {"step_s": seconds, "first_loss": first_loss,
                          "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
            del model, step
        plain_loss = row["plain"]["first_loss"]
        if abs(row["recompute_all"]["first_loss"] - plain_loss) > 1e-6 * abs(plain_loss):
            raise SystemExit(f"gpu_recompute: length {length}: the recomputing step's loss "
                             f"{row['recompute_all']['first_loss']} differs from the plain one {row['plain']['first_loss']}")
        row["recompute_over_plain"] = row["recompute_all"]["step_s"] / row["plain"]["step_s"]
        rows.append(row)
    return {"benchmark": "gpu_recompute", "model": f"bert-{config}", "batch": int(batch or spec.default_batch),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "repeats": repeats, "warmup": warmup, "rows": rows,
            # over lengths spread evenly, as an epoch of uniform lengths: the most an input-aware
            # plan could gain over recomputing everything at every length
            "ceiling_over_lengths": sum(r["recompute_all"]["step_s"] for r in rows) / sum(r["plain"]["step_s"] for r in rows)}


def print_result(result: dict[str, Any]) -> None:
    print(f"{result['model']} batch {result['batch']} on {result['device']} (torch {result['torch']})")
    print(f"{'length':>7}{'plain ms':>10}{'recompute ms':>14}{'ratio':>8}{'plain MiB':>11}{'recompute MiB':>15}")
    for r in result["rows"]:
        peaks = [r[k]["peak_bytes"] for k in ("plain", "recompute_all")]
        mib = [f"{p / 2**20:.1f}" if p is not None else "-" for p in peaks]
        print(f"{r['length']:>7}{r['plain']['step_s'] * 1e3:>10.2f}{r['recompute_all']['step_s'] * 1e3:>14.2f}"
              f"{r['recompute_over_plain']:>8.3f}{mib[0]:>11}{mib[1]:>15}")
    print(f"recompute-all over plain, summed over the lengths: {result['ceiling_over_lengths']:.3f}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_recompute", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", help="bert config (default small, as benchmarks/mimose.py)")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size (default the config's, 16 for small: small enough that a GPU step is "
                             "mostly kernel launches; larger batches show the compute share)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", required=True, help="JSON result file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n]
    except ValueError:
        raise SystemExit(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or args.repeats < 1 or args.warmup < 1 or (args.batch is not None and args.batch < 1):
        raise SystemExit("--lengths needs at least one length; --repeats, --warmup and --batch must be >= 1")
    result = measure(args.config, args.device, lengths, args.repeats, args.warmup, args.batch)
    print_result(result)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
