#!/usr/bin/env bash
# Static checks `make test` runs before the suites (versions pinned in constraints.txt):
# ruff (lint), mypy --strict on the layers below the daemon ([tool.mypy] files), and
# import-linter's layers contract (imports flow one way; [tool.importlinter] in pyproject.toml).
set -euo pipefail
bin=${1:-.venv}/bin
echo "check: ruff";         "$bin/ruff" check kvtier tests benchmarks
echo "check: mypy";         "$bin/mypy"
echo "check: lint-imports"; "$bin/lint-imports" --no-cache | tail -n 3
