#!/usr/bin/env bash
# Issue 47 on one 4-GPU machine, in calls of under 8.5 minutes each (corpus included;
# every call starts on a fresh machine and caches nothing):
#
#   bash scripts/fair_sweep.sh search        # the ~150M and ~25M searches (lr x warmup for
#                                            # AdamW and Muon), 2 GPUs each, side by side
#   bash scripts/fair_sweep.sh confirm 1b    # ~1B at the ~150M bests, seeds 0 and 1, FSDP
#                                            # over 4 GPUs a run
#   bash scripts/fair_sweep.sh confirm small # both searches finished, bests again at seed 1
#   bash scripts/fair_sweep.sh wait          # the data wait at ~1B (Markov chain, batch 64)
#
# Each sweep resumes from benchmarks/sweeps/fair_NAME.json where it exists, so after every
# call copy its $OUT/fair_*.json there (and wait_1b.json), then record (benchmarks/README.md,
# "Optimizers on real text"):
#
#   python3 benchmarks/sweep.py --from-json benchmarks/sweeps/fair_150m.json --write-table \
#       --plot docs/sweep_text_150m.png --write-defaults
#   python3 benchmarks/sweep.py --from-json benchmarks/sweeps/fair_25m.json --write-table \
#       --plot docs/sweep_text_25m.png
#   python3 benchmarks/sweep.py --from-json benchmarks/sweeps/fair_1b.json --write-table \
#       --plot docs/sweep_text_1b.png
#   python3 benchmarks/train_table.py --from-json benchmarks/sweeps/wait_1b.json --write-table
#
# TOTAL_S (default 480) bounds a call: no run starts that would end later (sweep.py
# --budget-s, from the longest run so far), and `timeout` stops a step that overruns anyway.
#
# Every argument and path is checked before anything is made: a refused call creates no
# folder, and nothing the caller names (OUT, CORPUS) is ever removed. A CORPUS folder
# without its built.txt (a build cut off, or another folder) is refused, not rebuilt over.
set -uo pipefail
cd "$(dirname "$0")/.."
USAGE="usage: bash scripts/fair_sweep.sh search | confirm 1b|small | wait"
STAGE="${1:-}"
PART="${2:-}"
OUT="${OUT:-out/fair_sweep}"
TOTAL_S="${TOTAL_S:-480}"
CORPUS="${CORPUS:-/tmp/corpus}"
PYTHON="${PYTHON:-python3}"
SWEEPS=benchmarks/sweeps
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

refuse() {
    echo "fair_sweep.sh: $*" >&2
    exit 2
}

case "$STAGE" in
    search | wait) [ $# -le 1 ] || refuse "$STAGE takes no second argument (got '$PART'); $USAGE" ;;
    confirm)
        case "$PART" in
            1b | small) ;;
            *) refuse "confirm '$PART': the part is 1b or small; $USAGE" ;;
        esac
        for name in 150m 25m; do
            [ -e "$SWEEPS/fair_$name.json" ] ||
                refuse "$SWEEPS/fair_$name.json is missing: run the search stage first"
        done
        ;;
    *) refuse "stage '$STAGE': search, confirm or wait; $USAGE" ;;
esac
if ! [[ "$TOTAL_S" =~ ^[0-9]+$ ]] || [ "$TOTAL_S" -lt 60 ]; then
    refuse "TOTAL_S=$TOTAL_S must be a whole number of seconds, at least 60"
fi
if [ "$STAGE" != wait ] && [ -e "$CORPUS" ] && [ ! -e "$CORPUS/built.txt" ]; then
    refuse "CORPUS=$CORPUS exists but holds no finished corpus ($CORPUS/built.txt is missing);" \
        "it is not removed: move it away or point CORPUS at another path"
fi
mkdir -p "$OUT"

left() { echo $((TOTAL_S - SECONDS)); }

N150="~150M (dim 1024, 12 layers)"
N25="~25M (dim 512, 8 layers)"
N1B="~1B (dim 2048, 20 layers)"
DATA=(--data "$CORPUS/train_*.bin" --eval-data "$CORPUS/val_*.bin" --seq-len 1024)
# 9.8M tokens a run at ~150M and ~1B (the same schedule, so warmups carry over), 52M at ~25M
# (about 2 tokens per parameter).
M150=(--dim 1024 --layers 12 --heads 16 --batch-size 32 --steps 300 --eval-every 20)
M25=(--dim 512 --layers 8 --heads 8 --batch-size 64 --steps 800 --eval-every 50)
M1B=(--dim 2048 --layers 20 --heads 16 --batch-size 32 --steps 300 --eval-every 20)
# Starting points: each line's first value is held while the other axis is searched.
GRID150=(--adamw-lrs 2.5e-4 1.25e-4 5e-4 --adamw-warmups 60 30 120
    --muon-lrs 0.01 0.005 0.02 --muon-warmups 30 15 60)
GRID25=(--adamw-lrs 5e-4 2.5e-4 1e-3 --adamw-warmups 80 40 160
    --muon-lrs 0.01 0.005 0.02 --muon-warmups 40 20 80)

build_corpus() {
    # Up to 200M tokens, so the ~25M runs' 52M tokens are drawn from more text than they read.
    # A machine still warm from the last call keeps the corpus it built (the same files).
    # make_corpus.py writes into a fresh sibling and renames it to CORPUS once whole.
    if [ -e "$CORPUS/built.txt" ]; then
        cp "$CORPUS/built.txt" "$OUT/corpus.txt"
    else
        "$PYTHON" scripts/make_corpus.py --out "$CORPUS" --max-tokens 200000000 \
            >"$OUT/corpus.txt" || exit 1
        cp "$OUT/corpus.txt" "$CORPUS/built.txt"
    fi
    tail -3 "$OUT/corpus.txt"
}

# sweep NAME GPUS BUDGET_S [sweep.py flags...] -- [training flags...]: one sweep into
# $OUT/NAME.log, its results.json to $OUT/fair_NAME.json, its logs to $OUT/logs_NAME.tar.gz.
sweep() {
    local name="$1" gpus="$2" budget="$3"
    shift 3
    if [ "$budget" -lt 30 ]; then
        echo "sweep $name: skipped, $(left) s left" >>"$OUT/stages.txt"
        return
    fi
    local logs
    logs="$(mktemp -d "/tmp/sweep_$name.XXXXXX")" # fresh: sweep.py writes only into an empty one
    timeout "$((budget + 40))" "$PYTHON" benchmarks/sweep.py --gpus "$gpus" --logs "$logs" \
        --budget-s "$budget" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    cp "$logs/results.json" "$OUT/fair_$name.json" 2>/dev/null
    cp "$logs/table.md" "$OUT/table_$name.md" 2>/dev/null
    cp "$logs/sweep.png" "$OUT/sweep_$name.png" 2>/dev/null
    tar -czf "$OUT/logs_$name.tar.gz" -C /tmp "$(basename "$logs")" 2>/dev/null
    echo "sweep $name: exit $status, $(left) s left" >>"$OUT/stages.txt"
}

summary() {
    cat "$OUT/stages.txt"
    for table in "$OUT"/table_*.md; do
        [ -e "$table" ] || continue
        echo "== $table"
        grep '^|' "$table" | grep -v -- '| --- |' | cut -c1-220
    done
}

case "$STAGE" in
    search)
        build_corpus
        budget=$(($(left) - 30))
        CUDA_VISIBLE_DEVICES=0,1 sweep 150m 2 "$budget" --model "$N150" "${GRID150[@]}" -- \
            "${DATA[@]}" "${M150[@]}" &
        CUDA_VISIBLE_DEVICES=2,3 sweep 25m 2 "$budget" --model "$N25" "${GRID25[@]}" -- \
            "${DATA[@]}" "${M25[@]}" &
        wait
        ;;
    confirm)
        # Every sweep resumes from its record in benchmarks/sweeps/ (what earlier calls
        # returned), so a call only adds the runs still missing: the ~1B runs at the ~150M
        # bests, each search finished, and each optimizer's best again at seed 1.
        for name in 150m 25m 1b; do
            [ -e "$SWEEPS/fair_$name.json" ] && cp "$SWEEPS/fair_$name.json" "/tmp/first_$name.json"
        done
        build_corpus
        case "$PART" in
            1b)
                resume=()
                [ -e /tmp/first_1b.json ] && resume=(--resume-from /tmp/first_1b.json)
                sweep 1b 4 "$(($(left) - 10))" --nproc 4 --model "$N1B" --seeds 0 1 \
                    --best-of /tmp/first_150m.json "${resume[@]}" -- "${DATA[@]}" "${M1B[@]}"
                ;;
            small)
                budget=$(($(left) - 20))
                CUDA_VISIBLE_DEVICES=0,1 sweep 150m 2 "$budget" --model "$N150" "${GRID150[@]}" \
                    --seeds 0 1 --resume-from /tmp/first_150m.json -- "${DATA[@]}" "${M150[@]}" &
                CUDA_VISIBLE_DEVICES=2,3 sweep 25m 2 "$budget" --model "$N25" "${GRID25[@]}" \
                    --seeds 0 1 --resume-from /tmp/first_25m.json -- "${DATA[@]}" "${M25[@]}" &
                wait
                ;;
        esac
        ;;
    wait)
        # The step's wait for its batch at ~1B, batch 64, 4 GPUs (Markov chain, vocab 8192).
        logs="$(mktemp -d /tmp/wait_1b.XXXXXX)"
        timeout 240 "$PYTHON" benchmarks/train_table.py --nproc 4 \
            --model "~1B dense (dim 2048, 20 layers)" --variants adamw muon --repeats 1 \
            --skip 10 --logs "$logs" -- --dim 2048 --layers 20 --heads 16 --vocab 8192 \
            --seq-len 1024 --batch-size 64 --steps 25 >"$OUT/wait_1b.log" 2>&1
        echo "data wait table: exit $?, $(left) s left" >>"$OUT/stages.txt"
        cp "$logs/results.json" "$OUT/wait_1b.json" 2>/dev/null
        cp "$logs/table.md" "$OUT/table_wait_1b.md" 2>/dev/null
        ;;
esac
summary
