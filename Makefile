# The two commands a fresh machine needs: `make run` (the demo) and `make test` (the suite).
PYTHON     ?= python3
VENV       ?= .venv
BIN         = $(VENV)/bin
STAMP       = $(VENV)/.kvtier-installed
# vLLM's CPU build lives in its own venv (scripts/setup-vllm-venv.sh); tests/vllm runs there.
VLLM_VENV  ?= .venv-vllm
VLLM_BIN    = $(VLLM_VENV)/bin
VLLM_STAMP  = $(VLLM_VENV)/.kvtier-installed
# SGLang's HiCache classes (sglang --no-deps on torch 2.13.0+cpu) in theirs: tests/sglang runs there.
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN   = $(SGLANG_VENV)/bin
SGLANG_STAMP = $(SGLANG_VENV)/.kvtier-installed

# Each suite runs its test files on this many pytest-xdist workers, a file's tests on one worker
# (module fixtures are shared within a file), files with a slow test first (tests/conftest.py).
# On one worker the vLLM suite left half the CPU idle (an engine starts one process at a time)
# and the main suite took 2.3 times as long: its tests mostly wait on daemons and Redis.
# The main suite on three: its tests wait on daemons, Redis and subprocesses more than they
# compute, and three workers took it from 298 s to 237 s here (two cores); the engine suites'
# engines compute, two keep them to a core each.
TEST_WORKERS ?= 2
MAIN_TEST_WORKERS ?= 3
PYTEST      = pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
MAIN_PYTEST = pytest -q -n $(MAIN_TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: run test test-vllm test-sglang check setup setup-vllm setup-sglang redis-server test-tools clean

run: $(STAMP) redis-server
	$(BIN)/kvtier demo

# Every part always runs; the target fails if any does.
test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) redis-server test-tools
	@status=0; \
	scripts/check-code.sh $(VENV) || status=1; \
	echo "$(BIN)/python -m $(MAIN_PYTEST)"; $(BIN)/python -m $(MAIN_PYTEST) || status=1; \
	echo "$(VLLM_BIN)/python -m $(PYTEST) tests/vllm"; $(VLLM_BIN)/python -m $(PYTEST) tests/vllm || status=1; \
	echo "$(SGLANG_BIN)/python -m $(PYTEST) tests/sglang"; $(SGLANG_BIN)/python -m $(PYTEST) tests/sglang || status=1; \
	exit $$status

check: $(STAMP)
	scripts/check-code.sh $(VENV)

test-vllm: $(VLLM_STAMP) redis-server test-tools
	$(VLLM_BIN)/python -m $(PYTEST) tests/vllm

setup: $(STAMP) redis-server

setup-vllm: $(VLLM_STAMP) redis-server

test-sglang: $(SGLANG_STAMP) redis-server test-tools
	$(SGLANG_BIN)/python -m $(PYTEST) tests/sglang

setup-sglang: $(SGLANG_STAMP) redis-server

# copy_hash.c: the compiled copy builds in place (kvtier/shm/), where every venv's editable install finds it.
$(STAMP): pyproject.toml constraints.txt scripts/setup-venv.sh scripts/ensure-build-tools.sh \
          kvtier/shm/native/copy_hash.c kvtier/shm/native/xxhash.h
	PYTHON=$(PYTHON) scripts/setup-venv.sh $(VENV)
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml constraints.txt scripts/setup-vllm-venv.sh scripts/lib-cpu-torch.sh scripts/ensure-build-tools.sh
	PYTHON=$(PYTHON) scripts/setup-vllm-venv.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

$(SGLANG_STAMP): pyproject.toml constraints.txt scripts/setup-sglang-venv.sh scripts/lib-cpu-torch.sh scripts/ensure-build-tools.sh
	PYTHON=$(PYTHON) scripts/setup-sglang-venv.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

redis-server:
	@scripts/ensure-redis-server.sh

test-tools:
	@scripts/ensure-test-tools.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache .hypothesis
