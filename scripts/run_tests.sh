#!/usr/bin/env bash
# Install into .venv (if needed) and run lint, the type checker and the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh --ignore-glob='*_slow.py'` for
# the quick tier (every test file but test_*_slow.py).
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
mypy
status=0
python -m pytest tests "$@" || status=$?
# pytest exits 5 when nothing was collected: that is a failure for us, not a pass.
exit "$status"
