#!/usr/bin/env bash
# Issue 38 on a GPU machine: AdamW, Muon, Muon --overlap backward and Muon --overlap auto on
# the ~1B example, interleaved (A B C D, A B C D, ...) and repeated, through
# benchmarks/train_table.py. One GPU count per call:
#
#   bash scripts/overlap_table.sh 4                # batches 16 and 64 on 4 GPUs
#   BATCHES=64 bash scripts/overlap_table.sh 4     # one batch size (one call per 10 minutes)
#
# Each batch size is 4 variants x REPEATS (3) runs of STEPS (25) steps, medians over the steps
# after SKIP (10), which also leaves out the 10 steps overlap="auto" measures before it
# chooses. A run costs its start (importing torch, the vocab-8192 Markov chain and the 1B
# model's init on the CPU, NCCL, the first steps' compilation) plus 25 steps: on 2 H200s at
# batch 16 (2026-11-27) the runs took 46-86 s each, so 4 variants x 3 repeats need about
# 11 minutes: where a call may last 10 minutes, give each batch size its own call with
# REPEATS=2 (about 8 minutes). Batches with more than MAX_ROWS_PER_GPU (32)
# sequences per GPU are left out: activations take about 1.7 MB per token (20 layers, bf16),
# 55 GB at 32 sequences of 1024 tokens, so batch 64 runs on 2 and 4 GPUs of 80 GB, not on 1.
#
# Into $OUT (at most 8 files come back from a device call): per batch size
# results_gN_bB.json (every per-step number of every run, run order, device, command),
# table_gN_bB.md and logs_gN_bB.tar.gz (each run's log and metrics.jsonl); the tables are
# printed last. Record them from any machine:
#   python3 benchmarks/train_table.py --from-json results_g4_b64.json --write-table
set -uo pipefail
cd "$(dirname "$0")/.."
GPUS="${1:?usage: bash scripts/overlap_table.sh NUM_GPUS}"
BATCHES="${BATCHES:-16 64}"
REPEATS="${REPEATS:-3}"
STEPS="${STEPS:-25}"
SKIP="${SKIP:-10}"
MAX_ROWS_PER_GPU="${MAX_ROWS_PER_GPU:-32}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-out/overlap_table}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

status=0
tables=()
for batch in $BATCHES; do
    if ((batch > MAX_ROWS_PER_GPU * GPUS)); then
        echo "batch $batch left out on $GPUS GPU(s): more than MAX_ROWS_PER_GPU=$MAX_ROWS_PER_GPU sequences per GPU"
        continue
    fi
    name="g${GPUS}_b${batch}"
    begin=$SECONDS
    if "$PYTHON" benchmarks/train_table.py --nproc "$GPUS" \
        --model "~1B dense (dim 2048, 20 layers)" --variants adamw muon "muon --overlap backward" \
        "muon --overlap auto" \
        --repeats "$REPEATS" --skip "$SKIP" --logs "$scratch/$name" -- \
        --dim 2048 --layers 20 --heads 16 --vocab 8192 --seq-len 1024 \
        --batch-size "$batch" --steps "$STEPS"; then
        cp "$scratch/$name/results.json" "$OUT/results_$name.json"
        cp "$scratch/$name/table.md" "$OUT/table_$name.md"
        tables+=("$OUT/table_$name.md")
    else
        status=1
        echo "$name failed: its logs are in $OUT/logs_$name.tar.gz"
    fi
    tar -czf "$OUT/logs_$name.tar.gz" -C "$scratch" "$name"
    echo "$name took $((SECONDS - begin)) s"
done
for table in "${tables[@]}"; do
    echo
    echo "== $(basename "$table")"
    cat "$table"
done
exit "$status"
