"""The README's table from overhead.json files: python table.py DIR... (one column per run)."""
import json, sys
from pathlib import Path
runs = [(Path(d).name, json.loads((Path(d) / "overhead.json").read_text())) for d in sys.argv[1:]]
def label(row):
    return {"ours[64]": "`max_block_nodes=64`", "ours[256]": "`max_block_nodes=256`", "ours[whole]": "whole graph"}.get(
        row["label"], "default") + f" ({row['blocks']} blocks)"
print("| outside ORT calls, CPU time (ms per step) | " + " | ".join(n for n, _ in runs) + " |")
print("|---|" + "---|" * len(runs))
for i, row in enumerate(runs[0][1]["ours"]):
    print(f"| {label(row)} | " + " | ".join(f"{r['ours'][i]['outside_ort_cpu_s'] * 1e3:.3f}" for _, r in runs) + " |")
def fit(f):
    per_block = f["per_block_s"]
    return f"{f['per_step_s'] * 1e3:.3f} ms {'+' if per_block >= 0 else '−'} {abs(per_block) * 1e6:.0f} µs"
print("| fit: per step + per block | " + " | ".join(fit(r["overhead"]["outside_ort_cpu"]) for _, r in runs) + " |")
print("| ours − plain session, fit (wall) | " + " | ".join(fit(r["overhead"]["vs_plain_session"]) for _, r in runs) + " |")
print("| plain session step (ms, wall) | " + " | ".join(f"{r['baseline']['median_step_s'] * 1e3:.2f}" for _, r in runs) + " |")
print("| default step (ms, wall) | " + " | ".join(f"{next(o for o in r['ours'] if o['is_default'])['median_step_s'] * 1e3:.2f}" for _, r in runs) + " |")
print("| max loss diff to plain | " + " | ".join(f"{max(o['max_loss_abs_diff'] for o in r['ours']):.1f}" for _, r in runs) + " |")
print("| peaks (B) | " + " | ".join(" / ".join(f"{o['peak_device_bytes']:,}" for o in r["ours"]) for _, r in runs) + " |")
