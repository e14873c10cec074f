# Two commands on a fresh machine: `make run` (setup + a real training run under a budget)
# and `make test` (setup + the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench zoo zoo-quick clean

setup: $(STAMP)

# torch first and pinned: a bare or newer torch downloads a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: setup
	$(PY) -m ort_offload train --model gpt --config small --budget 1.0x --steps 10 --verify

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.swap
	$(PY) -m benchmarks.peers
	$(PY) -m benchmarks.mimose

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
	rm -rf $(VENV) build *.egg-info .pytest_cache
