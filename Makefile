# Two entry points a newcomer needs: `make train` (set up, run the embedded default) and
# `make test` (set up, lint, type-check, run the default test suite). CI runs `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, with the pin, so nothing later can pull a CUDA build.
	$(BIN)/pip install -q "torch>=2.4,<=2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/copc train

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/ops_bench.py
	$(BIN)/python benchmarks/engine_bench.py
	$(BIN)/python benchmarks/step_time.py

clean:
	rm -rf $(VENV) build *.egg-info
