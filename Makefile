# One entry point for users and CI. A fresh machine needs only python3 (>= 3.8) with venv and pip:
# the first target that needs them creates .venv and installs colossalai (which brings its torch pin) and this package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 2
PYTEST_ARGS ?=
GPU_CHECK_ARGS ?=

.PHONY: install install-test demo test parity soak bench gpu-check lint format clean

$(VENV)/.stamp-base: setup.py requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PY) -m pip install -e ".[test,dev]"
	touch $@

install: $(VENV)/.stamp-base

install-test: $(VENV)/.stamp-test

# colossalai run shells out to torchrun, which must come from the venv too: the venv's bin goes first on PATH.
demo: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/colossalai run --nproc_per_node $(NPROC) examples/quickstart.py

test: install-test
	$(PY) -m pytest -n 2 $(PYTEST_ARGS) tests

# The collectives, and jax's shard_map tutorial ported line for line, against jax on the same numbers (also part of
# test, where jax installs).
parity: install-test
	$(PY) -m pytest -n 2 $(PYTEST_ARGS) tests/test_parity.py tests/test_shard_parity.py

bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.compile
	$(PY) -m benchmarks.wire_bytes
	$(PY) -m benchmarks.randomness
	$(PY) -m benchmarks.vma_overhead

# On a GPU machine: the checks on CUDA over nccl (one rank per GPU, up to 8), which steady calls synchronize the host,
# and cmap's all_gather / all_reduce against torch.distributed's at 1 KiB to 64 MiB per rank: ratios and the microseconds
# cmap adds per call (also checks/gpu_results.json). Under 10 minutes.
# Without CUDA it says so and exits 0. GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--nproc 2 --no-bench".
gpu-check: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m checks.gpu $(GPU_CHECK_ARGS)

lint: install-test
	$(PY) -m black --check -l 120 colossalai_cmap tests examples benchmarks checks setup.py
	$(PY) -m isort --check-only --profile black -l 120 colossalai_cmap tests examples benchmarks checks setup.py

format: install-test
	$(PY) -m black -l 120 colossalai_cmap tests examples benchmarks checks setup.py
	$(PY) -m isort --profile black -l 120 colossalai_cmap tests examples benchmarks checks setup.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# The chaos soak, longer: SOAK_CALLS random calls at each P = 2, 3, 4, each world then ended and its exits timed.
SOAK_CALLS ?= 2000
soak: install-test
	SOAK_CALLS=$(SOAK_CALLS) $(PY) -m pytest -s $(PYTEST_ARGS) tests/test_soak.py
