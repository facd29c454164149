# The two commands a fresh machine needs: `make run` (the demo) and `make test` (the suite).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.kvtier-installed

.PHONY: run test setup redis-server test-tools clean

run: $(STAMP) redis-server
	$(BIN)/kvtier demo

test: $(STAMP) redis-server test-tools
	$(BIN)/python -m pytest -q

setup: $(STAMP) redis-server

$(STAMP): pyproject.toml scripts/setup-venv.sh
	PYTHON=$(PYTHON) scripts/setup-venv.sh $(VENV)
	touch $(STAMP)

redis-server:
	@scripts/ensure-redis-server.sh

test-tools:
	@scripts/ensure-test-tools.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
