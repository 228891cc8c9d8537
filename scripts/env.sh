# Sourced by the quick-start scripts: a project virtual environment with pinned torch first,
# so a plain `torch` requirement never pulls the multi-GB CUDA wheels onto a CPU machine.
# Override the pin with TORCH_SPEC (for example TORCH_SPEC="torch==2.11.0").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${MUON_DIST_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[dev,examples,models]"
