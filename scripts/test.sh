#!/usr/bin/env bash
# The project's test command (README, CI): install (the active virtual environment, else .venv), lint,
# format check, type check, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/install.sh --test
# The tests start many servers and workers on the same few cores: bound OpenMP's spin-waiting so a 2-thread
# team does not collapse while its cores are shared (docs/cpu.md); the tests measure no speed.
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-1000}"
ruff check .
ruff format --check .
mypy
# pytest exits 5 when it collects no tests; set -e turns that (like any failure) into a red run.
python -m pytest -q -x --durations=20 tests
