#!/usr/bin/env bash
# Re-resolve constraints.txt: install the newest releases into a fresh virtual environment
# (scripts/env.sh with MUON_DIST_UPGRADE=1) and record their exact versions. Run the tests
# on them first (`MUON_DIST_UPGRADE=1 bash scripts/run_tests.sh`), then this, and commit the
# new constraints.txt with the CI run that passed on it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$VENV")"' EXIT
MUON_DIST_VENV="$VENV" MUON_DIST_UPGRADE=1 bash scripts/env.sh
{
    echo "# Exact versions of every test and example dependency, used by scripts/env.sh"
    echo "# (pip --constraint). Written by scripts/update_lock.sh with ${TORCH_SPEC:-torch==2.13.0}"
    echo "# on CPython $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)."
    echo "# torch is left to TORCH_SPEC, so no CUDA wheel is pulled in by a pin."
    "$VENV/bin/python" -m pip freeze --all --exclude-editable | grep -v -i -E '^torch=='
} >constraints.new
if grep -i -E '^(nvidia|cuda)-' constraints.new; then
    echo "update_lock.sh: CUDA packages (above) were installed; constraints.txt left as it was" >&2
    rm constraints.new
    exit 1
fi
mv constraints.new constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
