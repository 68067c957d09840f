# Two entry points: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build. On a GPU cluster
# install the CUDA build that matches the driver instead (`make setup TORCH=...`).
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint serve bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python >= 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: setup
	$(BIN)/tuneyard demo

lint: setup
	$(BIN)/ruff check app worker contract tests bench
	$(BIN)/ruff format --check app worker contract tests bench
	$(BIN)/mypy app worker contract

test: lint
	$(BIN)/python -m pytest

serve: setup
	$(BIN)/tuneyard serve

# Benchmarks against the alternatives; each appends its table to BENCHMARKS.md.
bench: setup
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) .tuneyard .pytest_cache .mypy_cache .ruff_cache
