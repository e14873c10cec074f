# Two commands on a fresh machine: `make run` (setup + a real training run under a budget)
# and `make test` (setup + the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-all bench zoo zoo-quick clean compat compat-test setup-gpu test-gpu

setup: $(STAMP)

# torch first and pinned: a bare or newer torch downloads a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The CUDA device's environment: onnxruntime-gpu (the CUDA 13 build, with the CUDA runtime
# packages it names) in place of onnxruntime, which provides the same module and cannot share a
# venv with it. torch from PyPI here is its CUDA build (several GB), which the GPU path uses for
# device memory, pinned host memory and streams. Our package goes in without its declared
# dependencies (they name onnxruntime); the others are installed by name.
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed
GPU_PACKAGES := onnxruntime-gpu[cuda,cudnn]==1.31.1 onnx==1.23.2 onnxscript==0.7.2 onnx-ir==1.1.0 numpy rich \
	matplotlib pytest hypothesis

setup-gpu: $(GPU_STAMP)

$(GPU_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet torch==2.13.0
	$(GPU_PY) -m pip install --quiet $(GPU_PACKAGES)
	$(GPU_PY) -m pip install --quiet --no-deps -e .
	touch $(GPU_STAMP)

# The GPU tests (tests/gpu; skipped where no GPU or no onnxruntime-gpu is found).
test-gpu: setup-gpu
	$(GPU_PY) -m pytest -q tests/gpu

# A second environment for ORT training artifacts (training_model.onnx of generate_artifacts):
# their com.microsoft gradient ops have kernels only in onnxruntime-training-cpu 1.19.2, which
# installs as the `onnxruntime` module (it cannot share .venv with onnxruntime 1.31) and loads
# IR <= 10 / opset <= 21 (onnx 1.17). torch first and pinned, as above; then the training build
# and our other dependencies at versions tested with it; last our package without its declared
# dependencies (they name onnxruntime 1.31 and onnx 1.23).
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
COMPAT_PACKAGES := onnxruntime-training-cpu==1.19.2 onnx==1.17.0 onnx-ir==1.1.0 onnxscript==0.7.2 \
	numpy==2.4.6 protobuf==7.36.2 rich matplotlib pytest hypothesis

compat: $(COMPAT_STAMP)

$(COMPAT_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet torch==2.13.0
	$(COMPAT_PY) -m pip install --quiet $(COMPAT_PACKAGES)
	$(COMPAT_PY) -m pip install --quiet --no-deps -e .
	touch $(COMPAT_STAMP)

# The ORT-artifact tests (tests/compat; the main suite ignores them where onnxruntime.training
# is missing).
compat-test: compat
	$(COMPAT_PY) -m pytest -q tests/compat

run: setup
	$(PY) -m ort_offload train --model gpt --config small --budget 1.0x --steps 10 --verify

# The fast suite: without the slow tests (fuzzing, kill loops, repeats of a check on more cases)
# and the tests that run the benchmark scripts; test-all runs everything (CI runs test-all).
# Both keep the tiny models' exports in .test-cache/ between runs (pytest --fresh-exports: afresh).
# Tests run in TEST_WORKERS processes (pytest-xdist), each file in one of them (module fixtures
# run once); the benchmark tests run alone after them, so that their timings see a quiet machine.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not slow and not bench"

test-all: setup
	$(PY) -m pytest -q $(PARALLEL) -m "not bench"
	$(PY) -m pytest -q -m bench

bench: setup
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.swap
	$(PY) -m benchmarks.peers
	$(PY) -m benchmarks.mimose
	$(PY) -m benchmarks.dynn

# Model-zoo regression: the nine onnx light zoo graphs and our zoo at 1.0x/0.5x/0.25x/min budgets.
# Deltas against (and, when everything passes, a new) benchmarks/zoo-baseline.json.
ZOO_OUT := benchmarks/results/zoo
zoo: setup
	mkdir -p $(ZOO_OUT)
	$(PY) -m ort_offload zoo --baseline benchmarks/zoo-baseline.json --json $(ZOO_OUT)/zoo.json --markdown $(ZOO_OUT)/zoo.md

# The fast subset (two light models and our tiny zoo at 0.5x) that the test suite also runs.
zoo-quick: setup
	mkdir -p $(ZOO_OUT)
	$(PY) -m ort_offload zoo --quick --baseline $(ZOO_OUT)/zoo-baseline-quick.json --json $(ZOO_OUT)/zoo-quick.json

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(GPU_VENV) build *.egg-info .pytest_cache .test-cache
