# Two commands on a fresh machine: `make run` (setup + a real training run under a budget)
# and `make test` (setup + the test suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
