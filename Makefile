# kvoffload developer entry points. Every target sets up .venv first if needed.
#   make run    set up, then start the service (CPU pool, loopback, embedded defaults)
#   make test   set up, then run the test suite
#   make lint   ruff check, ruff format --check, mypy
#   make bench  run every benchmark (tables on stdout, JSON under bench/results/)
#   make test-vllm  the tier's tests inside vLLM 0.33.0's real code (own venv: .venv-vllm)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvoffload-installed
# CPU wheel of torch used where no GPU is present; pinned because an unpinned
# torch on PyPI resolves to a multi-GB CUDA build.
CPU_TORCH ?= torch==2.13.0
# Optional extra index for torch (e.g. the PyTorch CPU wheel index on machines
# whose default index serves CUDA wheels only).
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=

.PHONY: setup run test test-vllm lint format bench clean

# vLLM test environment: vLLM without its dependencies (its CUDA stack is not needed on CPU),
# then only what its kv_offload modules import (requirements/vllm-test.txt), then this package.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvoffload-installed

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: GPU found, installing CUDA torch"; \
		$(PIP) install -q 'torch>=2.4'; \
	else \
		echo "setup: no GPU, installing CPU torch ($(CPU_TORCH))"; \
		$(PIP) install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(CPU_TORCH)'; \
	fi
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/kvoffload serve

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

$(VLLM_STAMP): pyproject.toml requirements/vllm-test.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(CPU_TORCH)'
	$(VLLM_PY) -m pip install -q --no-deps $$(grep -E '^vllm==' requirements/vllm-test.txt)
	$(VLLM_PY) -m pip install -q $$(grep -vE '^(#|vllm==|$$)' requirements/vllm-test.txt)
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	touch $(VLLM_STAMP)

# KVOFFLOAD_REQUIRE_VLLM=1: a missing vLLM fails the run instead of skipping the directory.
test-vllm: $(VLLM_STAMP)
	KVOFFLOAD_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) bench/manager_ops.py
	$(PY) bench/transfer_bw.py
	$(PY) bench/policy_sweep.py
	$(PY) bench/http_bench.py
	$(PY) bench/body_limits.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/results
