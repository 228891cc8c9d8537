# Sourced by the quick-start scripts: a project virtual environment with pinned torch first,
# so a plain `torch` requirement never pulls the multi-GB CUDA wheels onto a CPU machine.
# Override the pin with TORCH_SPEC (for example TORCH_SPEC="torch==2.11.0").
#
# constraints.txt holds the exact versions of every test and example dependency that CI
# passed with; every install below resolves within it, in a new virtual environment and an
# old one alike. MUON_DIST_UPGRADE=1 ignores it and takes the newest releases instead, to
# try them; scripts/update_lock.sh records them once the tests pass.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${MUON_DIST_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if [ "${MUON_DIST_UPGRADE:-0}" = 1 ]; then
    echo "env.sh: MUON_DIST_UPGRADE=1: constraints.txt ignored, newest releases installed" >&2
    PIN=(--upgrade --upgrade-strategy eager)
else
    PIN=(--constraint constraints.txt)
fi

install() {
    if ! python -m pip install -q "${PIN[@]}" "$@"; then
        echo "env.sh: pip could not install '$*' with ${PIN[*]}. constraints.txt was" \
            "resolved with torch==2.13.0 (CPU) on CPython 3.11; with another TORCH_SPEC or" \
            "Python, MUON_DIST_UPGRADE=1 resolves the newest versions instead." >&2
        exit 1
    fi
}

install pip
install "${TORCH_SPEC:-torch==2.13.0}"
# The build just installed stays: no dependency's upgrade may swap it for a CUDA wheel.
TORCH_PIN="$VENV/torch-pin.txt"
python -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' >"$TORCH_PIN"
install --constraint "$TORCH_PIN" -e ".[dev,examples,models]"
