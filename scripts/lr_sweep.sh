#!/usr/bin/env bash
# Issue 39 on a GPU machine: the offline corpus (scripts/make_corpus.py, from this machine's
# Python packages), then benchmarks/sweep.py on it, one run per GPU.
#
#   bash scripts/lr_sweep.sh 4                          # the ~150M proxy's line search
#   RUNS='adamw --adamw-lr 1e-3|muon --lr 0.02' MODEL=1b bash scripts/lr_sweep.sh 4
#                                                       # given variants at ~1B, no search
#
# MODEL=proxy: dim 1024, 12 layers (~150M), batch 32 x 1024 tokens; MODEL=1b: dim 2048,
# 20 layers (~1B), batch 16 x 1024. STEPS per run (300 / 1000), the eval every STEPS / 15
# steps on 4 fixed batches of held-out windows. BUDGET_S: no run starts that would end later
# than that (0: no limit). CORPUS_TOKENS caps the corpus (40M: the runs read under 20M).
# Into $OUT: corpus.txt (sizes, checksum), results.json, table.md, sweep.png, logs.tar.gz.
# Record from any machine: python3 benchmarks/sweep.py --from-json results.json --write-table
set -uo pipefail
cd "$(dirname "$0")/.."
GPUS="${1:?usage: bash scripts/lr_sweep.sh NUM_GPUS}"
MODEL="${MODEL:-proxy}"
OUT="${OUT:-out/lr_sweep}"
CORPUS="${CORPUS:-/tmp/corpus}"
CORPUS_TOKENS="${CORPUS_TOKENS:-40000000}"
BUDGET_S="${BUDGET_S:-0}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "$MODEL" in
    proxy)
        STEPS="${STEPS:-300}"
        name="~150M (dim 1024, 12 layers)"
        shape=(--dim 1024 --layers 12 --heads 16 --seq-len 1024 --batch-size 32)
        ;;
    1b)
        STEPS="${STEPS:-1000}"
        name="~1B (dim 2048, 20 layers)"
        shape=(--dim 2048 --layers 20 --heads 16 --seq-len 1024 --batch-size 16)
        ;;
    *)
        echo "MODEL=$MODEL: proxy or 1b" >&2
        exit 2
        ;;
esac
if [ ! -e "$CORPUS/val_000000.bin" ]; then
    "$PYTHON" scripts/make_corpus.py --out "$CORPUS" --max-tokens "$CORPUS_TOKENS" \
        >"$OUT/corpus.txt" || exit 1
fi
tail -3 "$OUT/corpus.txt"
logs="$(mktemp -d)/sweep"
runs=()
if [ -n "${RUNS:-}" ]; then
    IFS='|' read -r -a variants <<<"$RUNS"
    runs=(--runs "${variants[@]}")
fi
"$PYTHON" benchmarks/sweep.py --gpus "$GPUS" --model "$name" --logs "$logs" \
    --budget-s "$BUDGET_S" "${runs[@]}" -- \
    --data "$CORPUS/train_*.bin" --eval-data "$CORPUS/val_*.bin" "${shape[@]}" \
    --steps "$STEPS" --eval-every "$((STEPS / 15))"
status=$?
cp "$logs"/results.json "$logs"/table.md "$logs"/sweep.png "$OUT"/ 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$logs")" sweep
exit "$status"
