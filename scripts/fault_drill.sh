#!/usr/bin/env bash
# Issue 45 on a GPU machine: a worker SIGKILLed mid-run under torchrun --max-restarts 1 with
# NCCL, restarted, resumed from its last complete checkpoint, compared with an uninterrupted
# run (README, "Multi-node and faults"). One GPU count per call:
#
#   bash scripts/fault_drill.sh 2
#
# Three runs of examples/train.py on the synthetic Markov chain (no data, no internet), each
# STEPS (40) steps of a small model with fp32 Newton-Schulz and communication:
#   1. uninterrupted;
#   2. uninterrupted again: how far two runs of the same job differ on this machine at all
#      (NCCL and cuDNN/flash-attention kernels need not be bitwise reproducible, so the
#      restarted run is held to this floor, and to bitwise equality where the floor is 0);
#   3. --ckpt-every CKPT (10) --resume under --max-restarts 1, the worker of local rank 1
#      SIGKILLed as soon as step KILL_AT (25) is logged; torchrun restarts both workers,
#      which resume from step 20;
#   4. run 3's checkpoints and metrics copied, 64 bytes of the largest shard of its newest
#      checkpoint (step STEPS) flipped, then --resume: that checkpoint fails its digest, the
#      run falls back to the one before (step STEPS - CKPT) with one warning and replays.
# About 20-30 s a run (start, NCCL, 40 small steps), under 3 minutes in all. Logs, metrics
# and the result table go to $OUT (default out/fault_drill); the table is printed last.
# Without GPUs the same runs take CPU ranks (gloo); STEPS=8 CKPT=2 KILL_AT=5 is a quick
# dry run there.
set -uo pipefail
cd "$(dirname "$0")/.."
GPUS="${1:?usage: bash scripts/fault_drill.sh NUM_GPUS}"
STEPS="${STEPS:-40}"
CKPT="${CKPT:-10}"
KILL_AT="${KILL_AT:-25}"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-out/fault_drill}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

model=(--dim 256 --layers 4 --heads 4 --vocab 512 --seq-len 128 --batch-size "$((8 * GPUS))"
  --steps "$STEPS" --comm-dtype fp32 --ns-dtype fp32 --cuda-graph auto --no-progress)
launch=(-m torch.distributed.run --standalone --nproc-per-node "$GPUS")

for run in uninterrupted repeat; do
  echo "== $run"
  "$PYTHON" "${launch[@]}" examples/train.py "${model[@]}" --out "$scratch/$run" \
    --save-final "$scratch/$run.pt" >"$OUT/$run.log" 2>&1 || {
    echo "$run failed; tail of $OUT/$run.log:"
    tail -30 "$OUT/$run.log"
    exit 1
  }
done

echo "== killed: SIGKILL of local rank 1 at step $KILL_AT, torchrun --max-restarts 1"
"$PYTHON" "${launch[@]}" --max-restarts 1 examples/train.py "${model[@]}" --out "$scratch/killed" \
  --ckpt-every "$CKPT" --ckpt-dir "$scratch/killed/ckpt" --resume \
  --save-final "$scratch/killed.pt" >"$OUT/killed.log" 2>&1 &
agent=$!
killed=""
deadline=$((SECONDS + 180))
while [ -z "$killed" ] && kill -0 "$agent" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
  if grep -q "\"step\": $KILL_AT," "$scratch/killed/metrics.jsonl" 2>/dev/null; then
    for pid in $(pgrep -P "$agent"); do
      if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx LOCAL_RANK=1; then
        kill -9 "$pid" && killed="$pid"
      fi
    done
  fi
  sleep 0.05
done
wait "$agent"
rc=$?
cp "$scratch/killed/metrics.jsonl" "$OUT/killed_metrics.jsonl" 2>/dev/null

echo "== corrupted: 64 bytes of a shard of the newest checkpoint flipped, then --resume"
mkdir -p "$scratch/corrupted"
cp -r "$scratch/killed/ckpt" "$scratch/corrupted/ckpt"
cp "$scratch/killed/metrics.jsonl" "$scratch/corrupted/metrics.jsonl" 2>/dev/null
newest="$(find "$scratch/corrupted/ckpt" -maxdepth 1 -name 'step_*' -type d | sort | tail -1)"
"$PYTHON" - "$newest" <<'EOF'
import sys
from pathlib import Path

shard = max(Path(sys.argv[1]).glob("*.distcp"), key=lambda p: p.stat().st_size)
data = bytearray(shard.read_bytes())
middle = len(data) // 2
data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
shard.write_bytes(bytes(data))
print(f"flipped 64 bytes of {shard} at byte {middle}")
EOF
"$PYTHON" "${launch[@]}" examples/train.py "${model[@]}" --out "$scratch/corrupted" \
  --ckpt-every "$CKPT" --ckpt-dir "$scratch/corrupted/ckpt" --resume \
  --save-final "$scratch/corrupted.pt" >"$OUT/corrupted.log" 2>&1
corrupted_rc=$?

"$PYTHON" - "$scratch" "$OUT" "$killed" "$rc" "$corrupted_rc" <<'EOF'
import json
import sys
from pathlib import Path

import torch

scratch, out, killed, rc = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
corrupted_rc = int(sys.argv[5])


def resumed(run: str) -> str:
    log = (out / f"{run}.log").read_text()
    found = [line.split()[2] for line in log.splitlines() if line.startswith("[muon] resumed ")]
    return ", ".join(Path(r).name for r in found) or "none"


def warnings(run: str) -> int:
    log = (out / f"{run}.log").read_text()
    return sum(line.startswith("WARNING checkpoint") for line in log.splitlines())


def losses(run: str) -> dict[int, float]:
    path = scratch / run / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def compare(run: str) -> tuple[str, str, str]:
    ref, path = scratch / "uninterrupted.pt", scratch / f"{run}.pt"
    if not path.is_file():
        return "no final weights", "-", "-"
    a, b = torch.load(ref), torch.load(path)
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    rel = max(float((b[k].float() - a[k].float()).norm() / a[k].float().norm()) for k in a)
    la, lb = losses("uninterrupted"), losses(run)
    same = sorted(la) == sorted(lb) and all(la[s] == lb[s] for s in la)
    return ("yes" if bitwise else "no"), f"{rel:.2e}", ("yes" if same else "no")


rows = [
    ("repeat (noise floor)", "-", "-", *compare("repeat")),
    (
        "killed + restarted",
        f"pid {killed or 'none'} killed, exit {rc}",
        resumed("killed"),
        *compare("killed"),
    ),
    (
        "corrupted shard",
        f"newest shard flipped: {warnings('corrupted')} warning, exit {corrupted_rc}",
        resumed("corrupted"),
        *compare("corrupted"),
    ),
]
header = ("run vs uninterrupted", "fault", "resumed from", "weights bitwise", "max rel diff",
          "losses equal")
table = [header, *rows]
widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in table]
lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
text = f"fault drill, {torch.cuda.device_count()} x {device}, torch {torch.__version__}\n"
text += "\n".join(lines) + "\n"
(out / "table.md").write_text(text)
print(text)
EOF
