#!/usr/bin/env bash
# Install transformers and its dependencies offline, for benchmarks/bench_hf.py on a machine
# without internet (CPython 3.12, x86_64 Linux, torch and numpy already installed).
#
# The wheels are prepared beforehand on a machine with internet, into wheels/ (gitignored):
#
#   pip download --dest wheels --only-binary=:all: --implementation cp --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux_2_28_x86_64 -c constraints.txt \
#       transformers tokenizers safetensors huggingface_hub regex pyyaml
#   rm wheels/numpy-*.whl    # the device has numpy (torch's); about 29 MB remain
#
# This script installs exactly those wheels (no resolution, no index) into .hf_site/
# (gitignored), leaving the device's environment as it is; put it on the path after the
# repository:
#
#   bash scripts/device_hf_setup.sh && export PYTHONPATH=$PWD:$PWD/.hf_site
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shopt -s nullglob
wheels=(wheels/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "device_hf_setup.sh: no wheels in $PWD/wheels; prepare them as this script's header says" >&2
    exit 1
fi
"${PYTHON:-python3}" -m pip install --quiet --no-index --no-deps --target .hf_site "${wheels[@]}"
PYTHONPATH="$PWD:$PWD/.hf_site" "${PYTHON:-python3}" -c \
    "import transformers, tokenizers, safetensors; print('transformers', transformers.__version__, 'in', '$PWD/.hf_site')"
