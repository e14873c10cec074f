#!/usr/bin/env bash
# The device run of the CUDA device's benchmark, on the lent GPU machine, in one call.
#
# Here first: `../shared/gpu/stage` (onnxruntime-gpu in parts, .gpu-stage/) and
# `python -m benchmarks.gpu_ort export --graphs .gpu-graphs`. Then the parts' calls back to
# back, the last one being (carry .gpu-stage's last part, install.sh, the checksum, .gpu-graphs):
#
#   bash benchmarks/gpu_run.sh PARTS [SECONDS] [gpu_ort run options...]
#
# It installs the staged wheels into /tmp/site, prints the GPU and ONNX Runtime's providers,
# and runs `benchmarks.gpu_ort run` for SECONDS (default 300) writing under $OUT, then Mimose's
# epoch through our runtime (`benchmarks.gpu_ort_mimose run`, bert small from
# `python -m benchmarks.gpu_ort_mimose export --graphs .gpu-graphs`) for MIMOSE_SECONDS (default
# 90, a third per row; 0 skips it) over MIMOSE_STEPS batches (default 40) passed over
# MIMOSE_EPOCHS times (default 2: the second pass runs every length prepared). The sizes are a
# guess, no GPU has run it; a row stops at its share, and the rows are compared over the steps
# all of them ran.
set -u
parts=${1:?number of staged parts}; seconds=${2:-300}; shift; [ $# -gt 0 ] && shift
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
bash .gpu-stage/install.sh "$parts" || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())"
set -o pipefail
quiet() { grep -v -E "Warning|warn\(|plugin EP|F.linear"; }
python3 -m benchmarks.gpu_ort run --graphs .gpu-graphs --time-limit "$seconds" --steps 4 --block-memory \
  --out "$out" "$@" 2>&1 | quiet | tee "$out/gpu_ort.log"
# The conv blocks' workspace with cuDNN's fixed algorithm instead of its heuristic choice.
ORT_OFFLOAD_CUDNN_CONV_ALGO_SEARCH=DEFAULT python3 -m benchmarks.gpu_ort model --graphs .gpu-graphs \
  --models cnn --steps 4 --block-memory --rows 0.5x:swap,unlimited:none --time-limit 90 \
  --out "$out/cnn_default_algo" 2>&1 | quiet | tee -a "$out/gpu_ort.log"
# Mimose's epoch through our runtime: static vs input-aware recompute, each row its own process.
mimose_seconds=${MIMOSE_SECONDS:-90}
if [ "$mimose_seconds" != 0 ] && [ -f .gpu-graphs/bert-small.onnx ]; then
  python3 -m benchmarks.gpu_ort_mimose run --graphs .gpu-graphs --steps "${MIMOSE_STEPS:-40}" \
    --epochs "${MIMOSE_EPOCHS:-2}" --time-limit "$mimose_seconds" --out "$out" 2>&1 | quiet | tee "$out/gpu_ort_mimose.log"
fi
