#!/usr/bin/env bash
# Install into .venv (if needed) and run lint plus the whole test suite on CPU.
source "$(dirname "$0")/env.sh"
ruff check .
ruff format --check .
status=0
python -m pytest tests "$@" || status=$?
# pytest exits 5 when nothing was collected: that is a failure for us, not a pass.
exit "$status"
