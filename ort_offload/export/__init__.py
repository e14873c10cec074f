"""torch to one ONNX training-step graph: aten translations, optimizers appended as ONNX, ORT training artifacts, the export cache, and inputs for graphs that come as files."""
