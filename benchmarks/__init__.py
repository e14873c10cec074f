"""Benchmarks of ort_offload, each runnable as ``python -m benchmarks.<name>``.

- :mod:`benchmarks.overhead`: our block runtime against one plain ``onnxruntime.InferenceSession``
  over the whole training-step graph (median step-time ratio, measured side by side in one
  process), plus export and export-cache-hit times.

Results are written as JSON under ``benchmarks/results/<YYYY-MM-DD>/`` (or ``--out DIR``).
"""
