# Two entry points: `make demo` and `make test`. Both set everything up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first, pinned, then the project. On Linux, PyPI's torch==2.13.0 is the
# CUDA build (several GB of CUDA libraries); the CPU build comes from PyTorch's CPU index.
# This project's machines hold the CPU build on local disk, so plain `make setup` gets it
# there. Elsewhere pick the build with TORCH_INDEX (or pip options in TORCH itself), on a
# fresh venv (`make clean` first):
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu     # the CPU build
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128   # CUDA 12.8
#   make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# (a CUDA version the driver supports: `nvidia-smi` shows the highest).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# Each word quoted on its own: TORCH may carry pip options, and a range (`torch>=2.13`)
# must not become a shell redirection.
TORCH_PIP_ARGS := $(foreach word,$(TORCH),'$(word)') \
    $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')

.PHONY: setup demo test test-own-clusters lint serve bench gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python >= 3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e ".[dev]"
	# DeepSpeed's CPU ops (CPU Adam, shared-memory collectives), compiled once here rather
	# than in the first run that loads them (worker/training/jit_ops.py).
	$(BIN)/python -m worker.training.jit_ops
	touch $@

demo: setup
	$(BIN)/tuneyard demo

lint: setup
	$(BIN)/ruff check app worker contract tests bench
	$(BIN)/ruff format --check app worker contract tests bench
	$(BIN)/mypy app worker contract

# The suite in two halves, one after the other: everything but the end-to-end tests on a
# process per core, then the e2e lanes (tests/e2e/lanes.py), each with its own service and
# Ray head. Side by side, the two halves took about 40 minutes here (CI, 2 cores); one after
# the other, 25. Ray runs its workers at nice 15, so the other half's processes took the
# cores from the runs, and every run's many processes kept polling for longer than it needed.
# Both halves run whatever the first gives; the target fails if either failed.
test: lint
	$(BIN)/python -m pytest --ignore=tests/e2e; first=$$?; \
	$(BIN)/python -m pytest tests/e2e; second=$$?; \
	exit $$(( first || second ))

# The end-to-end tests that start a service and Ray cluster of their own (several nodes
# with object storage, a shared cluster with replicas on PostgreSQL, kill -9 of the
# service and of its Ray head, `serve --workers 2`): more than `make test` has time for on
# a 2-core machine.
test-own-clusters: setup
	$(BIN)/python -m pytest -m own_cluster

serve: setup
	$(BIN)/tuneyard serve

# Benchmarks against the alternatives; each appends its table to BENCHMARKS.md.
bench: setup
	$(BIN)/python -m bench.run_all

# On one GPU: a ~0.5B Llama through the service (ZeRO-2 and ZeRO-3, bf16) next to a plain
# DeepSpeed script; tokens/s, MFU, peak GPU memory. Not part of `bench` (it needs a GPU).
# `make gpu-check GPU_CHECK_ARGS=--dry-run` runs its code paths on CPU with a tiny model.
GPU_CHECK_ARGS ?=
gpu-check: setup
	$(BIN)/python -m bench.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .tuneyard .pytest_cache .mypy_cache .ruff_cache
