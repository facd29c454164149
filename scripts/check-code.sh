#!/usr/bin/env bash
# Static checks `make test` runs before the suites (versions pinned in constraints.txt):
# ruff (lint), mypy --strict on the layers below the daemon ([tool.mypy] files), import-linter's
# contracts (imports flow one way; [tool.importlinter] in pyproject.toml) and module size.
set -euo pipefail
bin=${1:-.venv}/bin
echo "check: ruff";         "$bin/ruff" check kvtier tests benchmarks
echo "check: mypy";         "$bin/mypy"
echo "check: lint-imports"; "$bin/lint-imports" --no-cache | tail -n 3
# Small modules: none over 350 lines (a longer one is split by what it does, not by line count).
echo "check: module size"
too_long=$(find kvtier -name '*.py' -exec wc -l {} + | awk '$2 != "total" && $1 > 350')
if [ -n "$too_long" ]; then echo "modules over 350 lines:"; echo "$too_long"; exit 1; fi
