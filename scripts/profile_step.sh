#!/usr/bin/env bash
# Issue 48 on a GPU machine: the per-step profile (benchmarks/profile_step.py) of the
# llama8b optimizer step (32 blocks), the same under Dion2 (its run-to-run spread), the
# qwen3moe one (8 blocks) and the ~1B example's training step (batch 64), each on GPUS (4)
# GPUs:
#
#   bash scripts/profile_step.sh
#
# Each profile is its own torchrun: start (import torch, NCCL) about 20 s, the model, 3
# warm-up steps (the first compiles and autotunes the Triton kernels, up to a minute on a
# fresh machine), 4 profiled steps and every rank's trace parsed: about 1.5 minutes for
# llama8b, 1 for Dion2 and for qwen3moe and 1.5 for the training step (estimated, not
# measured), each cut off at its LIMIT_* seconds so that one hang leaves the others'
# results.
#
# Into $OUT (at most 8 files come back from a device call): profile_step_<name>.json (every
# rank's per-step numbers, the slowest rank's medians, the plan's FLOPs per rank),
# table.md, logs.tar.gz (each run's log, every rank's summary_rank<r>.json) and rank 0's
# gzipped trace of llama8b and of the training step where under 15 MiB (read them with
# tools/trace_summary.py). The table is printed last; again from any machine:
#   python3 benchmarks/profile_step.py --from-json profile_step_*.json
# SMOKE=1 GPUS=2 runs the same four on CPU/gloo with tiny models and one step each: a dry
# run of this script where there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
GPUS="${GPUS:-4}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-out/profile_step}"
LIMIT_LLAMA="${LIMIT_LLAMA:-200}"
LIMIT_QWEN="${LIMIT_QWEN:-140}"
LIMIT_DION2="${LIMIT_DION2:-140}"
LIMIT_TRAIN="${LIMIT_TRAIN:-140}"
LLAMA=(--preset llama8b --layers 32)
DION2=(--preset llama8b --layers 32 --rule dion2)
QWEN=(--preset qwen3moe --layers 8)
TRAIN=(--train -- --dim 2048 --layers 20 --heads 16 --vocab 8192 --seq-len 1024 --batch-size 64)
STEPS=()
if [[ ${SMOKE:-0} == 1 ]]; then
    LLAMA=(--preset tiny --layers 1 --device cpu)
    DION2=(--preset tiny --layers 1 --device cpu --rule dion2)
    QWEN=(--preset small224 --layers 1 --device cpu)
    TRAIN=(--train -- --dim 32 --layers 2 --heads 2 --vocab 64 --seq-len 32 --batch-size 4)
    STEPS=(--warmup 1 --steps 1)
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

status=0
profile() {
    local name="$1" limit="$2"
    shift 2
    local begin=$SECONDS
    mkdir -p "$scratch/$name"
    if timeout --kill-after 10 "$limit" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node "$GPUS" benchmarks/profile_step.py --name "$name" --out "$OUT" \
        --trace-dir "$scratch/$name" "${STEPS[@]}" "$@" >"$scratch/$name.log" 2>&1; then
        echo "$name: $((SECONDS - begin)) s"
    else
        status=1
        echo "$name FAILED after $((SECONDS - begin)) s; the end of its log:"
        tail -n 15 "$scratch/$name.log"
    fi
}

profile llama8b "$LIMIT_LLAMA" "${LLAMA[@]}"
profile llama8b_dion2 "$LIMIT_DION2" "${DION2[@]}"
profile qwen3moe "$LIMIT_QWEN" "${QWEN[@]}"
profile train1b "$LIMIT_TRAIN" "${TRAIN[@]}"

for name in llama8b train1b; do
    trace="$scratch/$name/trace_rank0.json"
    [[ -f $trace ]] || continue
    gzip -c "$trace" >"$OUT/trace_${name}_rank0.json.gz"
    if (($(stat -c %s "$OUT/trace_${name}_rank0.json.gz") > 15 * 2 ** 20)); then
        rm "$OUT/trace_${name}_rank0.json.gz"
        echo "rank 0's $name trace left out: over 15 MiB gzipped"
    fi
done
(cd "$scratch" && tar -czf - ./*.log ./*/summary_rank*.json) >"$OUT/logs.tar.gz"
reports=("$OUT"/profile_step_*.json)
if [[ -f ${reports[0]} ]]; then
    "$PYTHON" benchmarks/profile_step.py --from-json "${reports[@]}" | tee "$OUT/table.md"
else
    status=1
    echo "no profile finished"
fi
exit "$status"
