"""Record a run of examples/train.py in the training table of benchmarks/README.md.

    python3 benchmarks/train_table.py out --model "~1B dense (dim 2048, 20 layers)" \
        --command "torchrun --standalone --nproc-per-node 4 examples/train.py ..."

Reads ``out/metrics.jsonl`` and writes one row per optimizer in it: medians of the
forward+backward and optimizer times over the steps after ``--skip`` warm-up steps, tokens/s
from those medians, and the final loss as the mean of the last 10 steps. Run it on the
machine that trained (it records that machine's device and versions) with the training
command as it was typed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import tables

FINAL_STEPS = 10
NAMES = {"muon": "muon_dist Muon", "adamw": "torch AdamW"}


def rows(metrics: list[dict], model: str, skip: int) -> tuple[list[dict[str, str]], int]:
    """The table's rows, and the world size the run used."""
    out = []
    worlds = {r["world_size"] for r in metrics}
    if len(worlds) != 1:
        raise ValueError(f"metrics.jsonl mixes world sizes {sorted(worlds)}; record one run")
    (world_size,) = worlds
    for optimizer in dict.fromkeys(r["optimizer"] for r in metrics):
        steps = sorted((r for r in metrics if r["optimizer"] == optimizer), key=lambda r: r["step"])
        timed = steps[skip:]
        if not timed:
            raise ValueError(f"{optimizer}: {len(steps)} steps, none left after --skip {skip}")
        fwd_bwd = statistics.median(r["fwd_bwd_s"] for r in timed)
        opt = statistics.median(r["opt_s"] for r in timed)
        tokens_per_step = steps[0]["tokens"] // steps[0]["step"]
        final = statistics.fmean(r["loss"] for r in steps[-FINAL_STEPS:])
        out.append(
            {
                "model": model,
                "GPUs": str(world_size),
                "optimizer": NAMES.get(optimizer, optimizer),
                "forward+backward ms": f"{fwd_bwd * 1e3:.1f}",
                "optimizer step ms": f"{opt * 1e3:.1f}",
                "optimizer share": f"{opt / (fwd_bwd + opt):.1%}",
                "tokens/s": f"{tokens_per_step / (fwd_bwd + opt):,.0f}",
                "final loss": f"{final:.2f}",
            }
        )
    return out, world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the training run's --out folder")
    parser.add_argument("--model", required=True, help="the model column, e.g. its size")
    parser.add_argument("--command", required=True, help="the training command as typed")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of medians")
    args = parser.parse_args()
    lines = (args.out / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines if line.strip()]
    table_rows, world_size = rows(metrics, args.model, args.skip)
    tables.record("training", table_rows, tables.run_info(gpus=world_size, command=args.command))
    print(tables.markdown("training"))


if __name__ == "__main__":
    main()
