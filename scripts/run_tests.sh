#!/usr/bin/env bash
# Install into .venv (if needed) and run lint, the type checker and the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh --ignore-glob='*_slow.py'` for
# the quick tier (every test file but test_*_slow.py).
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
mypy
status=0
# Two workers (pytest-xdist), each taking whole files, so a file's fixtures are built once:
# the example's launches and the ranks leave a core idle much of the time, which the second
# worker fills. MUON_DIST_TEST_WORKERS=0 runs the suite in one process.
python -m pytest tests -n "${MUON_DIST_TEST_WORKERS:-2}" --dist loadfile "$@" || status=$?
# pytest exits 5 when nothing was collected: that is a failure for us, not a pass.
exit "$status"
