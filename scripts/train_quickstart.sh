#!/usr/bin/env bash
# Install into .venv (if needed) and run the main job: a 2-process CPU training run.
source "$(dirname "$0")/env.sh"
torchrun --standalone --nproc-per-node "${NPROC:-2}" examples/train.py --out out "$@"
