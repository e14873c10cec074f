"""What writing a rewritten graph back to protobuf costs the planner: the recompute planner's
writer (`RecomputeWriter`) writing every single-segment plan of a step graph, back to protobuf
through its `ProtoMirror` (only the touched nodes serialized) and through a full `ir.to_proto`
of the same edited graph, side by side in one run (CPU time of this process). Every write is
checked byte for byte against the full conversion.

    python -m benchmarks.proto_mirror [--models gpt:tiny,bert:small] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks import common as bench

DEFAULT_MODELS = "gpt:tiny,bert:small"


def _step_graph(name: str, config: str):
    """The zoo model's training-step graph and its tensor infos for one batch."""
    from graph_passes.ir import shapes
    from models import get_model
    from ort_offload.export.training_step import export_training_step, initial_state

    spec = get_model(name, config)
    inputs, targets = spec.make_batch(seed=0)
    graph = export_training_step(spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
                                 input_names=spec.input_names, target_names=spec.target_names,
                                 dynamic_axes=spec.dynamic_axes, optimizer="adamw", name=f"{name}-{config}").graph
    feeds = initial_state(graph, spec.model, lr=1e-3)
    feeds.update({n: t.numpy() for n, t in zip(graph.data_inputs, tuple(inputs) + tuple(targets))})
    return graph, shapes.infer_tensor_infos(graph.model, shapes.check_inputs(graph.model, feeds))


def measure_model(name: str, config: str, repeats: int) -> dict[str, Any]:
    """One row: CPU seconds per write through the mirror and through a full conversion."""
    import onnx_ir as ir

    from graph_passes.planning.recompute.graph_pass import RecomputeWriter, recompute_in_place
    from graph_passes.planning.recompute.planner import RecomputePlan, forward_segments

    graph, infos = _step_graph(name, config)
    segments = forward_segments(graph.model, infos, loss_name=graph.loss_name)
    writer = RecomputeWriter(graph.model, loss_name=graph.loss_name)
    mirror_s = full_s = 0.0
    for _ in range(repeats):
        for segment in segments:
            edits = recompute_in_place(writer.model.graph, RecomputePlan((segment,)), loss_name=graph.loss_name)
            start = time.process_time()
            mirrored = writer.mirror.to_proto()
            mirror_s += time.process_time() - start
            start = time.process_time()
            full = ir.to_proto(writer.model)
            full_s += time.process_time() - start
            if mirrored.SerializeToString() != full.SerializeToString():
                raise AssertionError(f"{name} {config}: the mirror wrote another graph than ir.to_proto")
            edits.undo()
    writes = repeats * len(segments)
    return {"model": f"{name} {config}", "nodes": len(graph.model.graph.node), "writes": writes,
            "mirror_ms_per_write": 1e3 * mirror_s / writes, "full_ms_per_write": 1e3 * full_s / writes,
            "bytes_equal": True}


def _print_table(result: dict[str, Any], console) -> None:
    from rich.table import Table

    table = Table(title="Writing a recompute rewrite back to protobuf (CPU ms per write)")
    for column in ("model", "nodes", "writes", "mirror ms", "full ms", "full / mirror", "bytes equal"):
        table.add_column(column, justify="right")
    for row in result["rows"]:
        table.add_row(row["model"], str(row["nodes"]), str(row["writes"]), f"{row['mirror_ms_per_write']:.1f}",
                      f"{row['full_ms_per_write']:.1f}", f"{row['full_ms_per_write'] / row['mirror_ms_per_write']:.2f}",
                      "yes" if row["bytes_equal"] else "no")
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.proto_mirror", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of name:config (default {DEFAULT_MODELS})")
    parser.add_argument("--repeats", type=int, default=3, help="writes of each plan (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="directory for proto_mirror.json")
    args = parser.parse_args(argv)
    models = [tuple(item.split(":", 1)) for item in args.models.split(",") if item]
    if args.repeats < 1 or any(len(m) != 2 for m in models):
        parser.error("--models takes name:config items and --repeats a positive count")

    def measure(log) -> dict[str, Any]:
        rows = []
        for name, config in models:
            log(f"{name} {config}: exporting and writing")
            rows.append(measure_model(name, config, args.repeats))
        return {"rows": rows}

    return bench.run_main(module="benchmarks.proto_mirror", result_file="proto_mirror.json", argv=argv, out=args.out,
                          table_width=100, measure=measure, print_table=_print_table)


if __name__ == "__main__":
    raise SystemExit(main())
