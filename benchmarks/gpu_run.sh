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
# and runs `benchmarks.gpu_ort run` for SECONDS (default 300) writing under $OUT.
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
