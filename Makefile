# Two entry points a newcomer needs: `make train` (set up, run the embedded default) and
# `make test` (set up, lint, type-check, run the default test suite). CI runs `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# verl lives in its own environment (about 2 GB with CPU torch), so `make test` stays light.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed

.PHONY: setup setup-verl train test test-slow test-verl lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, with the pin, so nothing later can pull a CUDA build.
	$(BIN)/pip install -q "torch>=2.4,<=2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

$(VERL_STAMP): pyproject.toml
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	# torch first, with the pin: plain verl then keeps it (verl's vllm/sglang/fsdp/cpu extras would pin 2.11).
	$(VERL_VENV)/bin/pip install -q "torch>=2.4,<=2.13.0"
	$(VERL_VENV)/bin/pip install -q -e ".[dev,verl]"
	touch $(VERL_STAMP)

setup-verl: $(VERL_STAMP)

train: $(STAMP)
	$(BIN)/copc train

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The verl plugin's tests, in the verl environment (CI runs them after `make test`).
test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q -m verl tests/integrations

bench: $(STAMP)
	$(BIN)/python benchmarks/ops_bench.py
	$(BIN)/python benchmarks/engine_bench.py
	$(BIN)/python benchmarks/step_time.py

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info
