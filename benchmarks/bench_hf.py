"""Train transformers' own models under FSDP2 with each optimizer: whole training steps,
interleaved and repeated in one run, against torch's fused AdamW.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_hf.py --model qwen3-dense \\
        --batch 32 --seq 1024 --json runs/hf_qwen3_dense.json
    python3 benchmarks/bench_hf.py --from-json runs/hf_qwen3_dense.json --write-table

The models are transformers' code (Qwen3, Qwen3-MoE with its fused 3-D expert stacks, Llama)
built from configs with random weights: nothing is downloaded. Each decoder layer and then
the root get ``fully_shard`` with a bf16 ``MixedPrecisionPolicy`` (fp32 gradient
reduction), as the README's Usage says; ``muon_dist.param_groups(model)`` routes them, and
the Muon variants are built as a user builds them (``Muon(groups, lr=0.02, adamw_lr=3e-4,
weight_decay=0.1)``: ``muon`` keeps Muon's default ``cuda_graph="auto"``, which captures the
step on CUDA, ``muon-eager`` passes ``cuda_graph=False``). The data are bytes (token ids
0..255): random, or windows of ``--data FILE``, drawn before each step's clock starts.

Variants run in rounds (A B C, A B C, ...), each run a fresh model and optimizer in this
process, freed before the next. A step is timed from a common start (barrier, then
synchronize) to the end of ``zero_grad()`` and a synchronize; its time is the slowest
rank's. A run's figure is the median of its steps after ``--skip``; a variant's cell is the
median of its runs' medians (min–max over runs); "vs AdamW" is the ratio of median tokens/s
(min–max of the ratios of runs paired by round); peak memory is the largest
``torch.cuda.max_memory_allocated`` of any rank and run. ``optimizer ms`` is the stream time
from the end of backward to the end of ``zero_grad()`` (CUDA events; the host's own time on
CPU), the slowest rank's.

``--momentum-dtype fp32 bf16`` runs every Muon variant a second time with
``momentum_dtype="bf16"`` (named ``<variant>-bf16m``) in the same rounds, so loss, step
time and peak memory of bf16 and fp32 momenta compare side by side.

``--tiny`` shrinks every model to a few layers of width 64 (CPU, gloo; the test's run).
``--dion PATH`` adds microsoft/dion's Muon (its Triton Newton–Schulz, AdamW for the rest)
from a checkout at PATH, where it runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tables
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from train_table import BASELINE, add_vs_baseline, cell, spread

LR, ADAMW_LR, WEIGHT_DECAY, BETAS = 0.02, 3e-4, 0.1, (0.9, 0.95)
VARIANTS = (
    "adamw",
    "muon",
    "muon-eager",
    "muon-graph",
    "normuon",
    "normuon-eager",
    "dion2",
    "dion2-eager",
)
DEFAULT_VARIANTS = ("adamw", "muon", "muon-eager", "normuon", "dion2")
# A Muon variant named with this suffix stores its momenta in bf16 (momentum_dtype="bf16");
# --momentum-dtype runs each Muon variant with each dtype named, side by side in a round.
BF16_MOMENTUM = "-bf16m"
MOMENTUM_DTYPES = {"fp32": "", "bf16": BF16_MOMENTUM}
MUON_VARIANTS = tuple(v for v in VARIANTS if v != BASELINE)
LEGEND = (
    "Whole training steps (forward, backward, optimizer step, zero_grad) of transformers' "
    "model code under FSDP2 (bf16 MixedPrecisionPolicy, each decoder layer and the root "
    "sharded), random init, byte-level data. Cells: median over runs of each run's median "
    "step, the slowest rank's (min–max over runs). optimizer ms: stream time from the end "
    "of backward to the end of zero_grad. vs AdamW: ratio of the median tokens/s (min–max "
    "over runs paired by round). peak GiB: the largest max_memory_allocated of any rank. "
    "last loss: the loss of each run's last step, median (min–max) over runs (on --data "
    "text it compares optimizers; on random bytes it stays near ln 256). muon, normuon, "
    "dion2: Muon's default cuda_graph='auto' (captured on CUDA); -eager: cuda_graph=False; "
    "-graph: cuda_graph=True; -bf16m: momentum_dtype='bf16' (bf16 momenta, fp32 "
    "arithmetic; the others keep fp32 momenta)."
)


@dataclass(frozen=True)
class ModelSpec:
    """A transformers model family at one size: its table label (``{params}``: the
    parameter count), config class name and config arguments (``tiny``: the CPU test's)."""

    label: str
    module: str
    config: str
    causal_lm: str
    full: dict[str, Any]
    tiny: dict[str, Any]


_TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}

MODELS: dict[str, ModelSpec] = {
    "qwen3-dense": ModelSpec(
        "Qwen3 dense {params} (dim 768, 16 layers, byte vocab)",
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "vocab_size": 256,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 16,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "head_dim": 64,
            "tie_word_embeddings": False,
        },
        _TINY,
    ),
    "qwen3-moe": ModelSpec(
        "Qwen3-MoE {params} (16 experts, top-2, dim 512, 9 layers, byte vocab)",
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "vocab_size": 256,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "moe_intermediate_size": 512,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 9,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "tie_word_embeddings": False,
        },
        {**_TINY, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    ),
    "llama-1b": ModelSpec(
        "Llama-3.2-1B shapes, {params} (dim 2048, 16 layers, vocab 128256, tied)",
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
        {**_TINY, "tie_word_embeddings": True},
    ),
}


# -- set-up ----------------------------------------------------------------------------


def init_distributed() -> torch.device:
    """The process group (NCCL on CUDA, gloo on CPU; a single process without torchrun) and
    this rank's device."""
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def build_model(spec: ModelSpec, tiny: bool, device: torch.device, mesh: DeviceMesh) -> nn.Module:
    """The model in fp32 with random weights (the same on every rank and in every run),
    each decoder layer and then the root sharded with a bf16 mixed-precision policy."""
    import importlib

    module = importlib.import_module(f"transformers.models.{spec.module}")
    config = getattr(module, spec.config)(**(spec.tiny if tiny else spec.full), use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model: nn.Module = getattr(module, spec.causal_lm)(config)
    model.train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build_optimizer(
    variant: str, model: nn.Module, device: torch.device, mesh: DeviceMesh, dion: Path | None
) -> torch.optim.Optimizer:
    """``variant``'s optimizer over ``model``, as a user builds it."""
    if variant == BASELINE:
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0}],
            lr=ADAMW_LR,
            betas=BETAS,
            fused=device.type == "cuda",
        )
    import muon_dist

    if variant == "dion":
        assert dion is not None
        return make_dion(dion, model, mesh)
    rule, _, mode = variant.removesuffix(BF16_MOMENTUM).partition("-")
    # The plain variant keeps Muon's default (cuda_graph="auto"); -bf16m adds bf16 momenta.
    options = {"": {}, "eager": {"cuda_graph": False}, "graph": {"cuda_graph": True}}[mode]
    if variant.endswith(BF16_MOMENTUM):
        options = {**options, "momentum_dtype": "bf16"}
    groups = muon_dist.param_groups(model)
    return muon_dist.Muon(
        groups, lr=LR, adamw_lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, rule=rule, **options
    )


def make_dion(root: Path, model: nn.Module, mesh: DeviceMesh) -> torch.optim.Optimizer:
    """microsoft/dion's Muon (Triton Newton–Schulz) on the matrices muon_dist's routing
    sends to Muon, its AdamW on the rest (a rival, imported from the folder the user
    names; nothing of it is part of this project)."""
    import muon_dist

    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from dion import Muon as DionMuon  # type: ignore[import-not-found]  # the rival, at run time

    matrices, rest = [], []
    for group in muon_dist.param_groups(model):
        (matrices if group["algorithm"] == "muon" else rest).extend(group["params"])
    groups = [
        {"params": matrices},
        {"params": rest, "algorithm": "adamw", "lr": ADAMW_LR, "weight_decay": 0.0},
    ]
    optimizer: torch.optim.Optimizer = DionMuon(
        groups,
        distributed_mesh=mesh,
        lr=LR,
        mu=0.95,
        betas=BETAS,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        adjust_lr="spectral_norm",
        use_triton=True,
    )
    return optimizer


class ByteData:
    """Batches of token ids 0..255, ``[local batch, seq]`` on this rank: uniform random, or
    random windows of a file's bytes; the same for every variant (seeded by step)."""

    def __init__(self, path: Path | None, local_batch: int, seq: int, rank: int) -> None:
        self.bytes = None if path is None else np.fromfile(path, dtype=np.uint8)
        if self.bytes is not None and len(self.bytes) <= seq:
            raise SystemExit(f"--data {path}: {len(self.bytes)} bytes, fewer than --seq {seq}")
        self.shape = (local_batch, seq)
        self.rank = rank

    def batch(self, step: int, device: torch.device) -> torch.Tensor:
        gen = np.random.default_rng([self.rank, step])
        if self.bytes is None:
            ids = gen.integers(0, 256, size=self.shape)
        else:
            starts = gen.integers(0, len(self.bytes) - self.shape[1], size=self.shape[0])
            ids = np.stack([self.bytes[s : s + self.shape[1]] for s in starts])
        return torch.from_numpy(ids.astype(np.int64)).to(device)


# -- timing ----------------------------------------------------------------------------


class StepClock:
    """Per-step wall time from a common start and the optimizer's stream time, per rank."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.walls: list[float] = []
        self.marks: list[tuple[Any, Any]] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextmanager
    def step(self) -> Iterator[Callable[[], None]]:
        """Time one step; the caller calls the yielded function where backward ended."""
        dist.barrier()
        self.sync()
        begin = time.perf_counter()
        marks: list[Any] = []

        def mark() -> None:
            """A point in the stream's time (a CUDA event), or the host's on CPU."""
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append(event)
            else:
                marks.append(time.perf_counter())

        yield mark  # where backward ended
        mark()
        self.sync()
        self.walls.append(time.perf_counter() - begin)
        self.marks.append((marks[0], marks[1]))

    def slowest(self) -> tuple[list[float], list[float]]:
        """Per step, the slowest rank's wall seconds and optimizer seconds."""
        if self.cuda:
            opt = [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        else:
            opt = [b - a for a, b in self.marks]
        both = torch.tensor([self.walls, opt], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        walls, opts = both.tolist()
        return walls, opts


def peak_gib(device: torch.device) -> float | None:
    """The largest ``max_memory_allocated`` of any rank since the last reset (None on CPU)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def free(device: torch.device) -> None:
    """Return the last run's memory before the next run is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()


def train_run(
    variant: str,
    args: argparse.Namespace,
    device: torch.device,
    mesh: DeviceMesh,
    data: ByteData,
) -> dict[str, Any]:
    """One run: a fresh model and optimizer, ``args.steps`` timed steps; every step's
    slowest-rank times, the peak memory and the last loss."""
    free(device)
    model = build_model(MODELS[args.model], args.tiny, device, mesh)
    params = sum(p.numel() for p in model.parameters())  # DTensors: the whole tensors'
    optimizer = build_optimizer(variant, model, device, mesh, args.dion)
    clock = StepClock(device)
    losses: list[torch.Tensor] = []
    for step in range(args.steps):
        ids = data.batch(step, device)
        with clock.step() as backward_done:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            backward_done()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    walls, opts = clock.slowest()
    peak = peak_gib(device)
    last = float(torch.stack(losses).float().cpu()[-1])
    note = getattr(optimizer, "uncaptured_reason", None)
    del model, optimizer, losses, loss
    free(device)
    return {
        "step_s": walls,
        "opt_s": opts,
        "peak_gib": peak,
        "last_loss": last,
        "note": note,
        "params": params,
    }


# -- summary and table -----------------------------------------------------------------


def summarize(runs: Sequence[dict[str, Any]], skip: int, tokens: int) -> dict[str, Any]:
    """Per variant: median of run medians with min–max (step, optimizer, tokens/s), the
    ratio of tokens/s to AdamW's (min–max of per-round ratios), the peak memory, and the
    loss of each run's last step (median with min–max)."""
    medians = []
    for run in runs:
        step = statistics.median(run["step_s"][skip:])
        opt = statistics.median(run["opt_s"][skip:])
        medians.append({"step_s": step, "opt_s": opt, "tokens_per_s": tokens / step})
    by_round = {(r["round"], r["variant"]): m for r, m in zip(runs, medians, strict=True)}
    summary: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [m for r, m in zip(runs, medians, strict=True) if r["variant"] == variant]
        entry: dict[str, Any] = {"runs": len(mine)}
        for metric in ("step_s", "opt_s", "tokens_per_s"):
            entry[metric] = spread([m[metric] for m in mine])
        peaks = [r["peak_gib"] for r in runs if r["variant"] == variant]
        entry["peak_gib"] = None if None in peaks else max(peaks)
        entry["last_loss"] = spread([r["last_loss"] for r in runs if r["variant"] == variant])
        summary[variant] = entry
    if BASELINE in summary:
        add_vs_baseline(summary, by_round)
    return summary


def table_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """The ``hf`` table's rows of one run of this benchmark."""
    rows = []
    for variant, entry in results["summary"].items():
        ratio = entry.get("vs_baseline")
        rows.append(
            {
                "model": results["label"],
                "GPUs": str(results["world_size"]),
                "batch × seq": f"{results['batch']} × {results['seq']}",
                "optimizer": variant,
                "step ms": cell(entry["step_s"], 1e3, ".1f"),
                "optimizer ms": cell(entry["opt_s"], 1e3, ".1f"),
                "tokens/s": cell(entry["tokens_per_s"], 1, ",.0f"),
                "vs AdamW": "—" if ratio is None else cell(ratio, 1, ".3f", "×"),
                "peak GiB": "—" if entry["peak_gib"] is None else f"{entry['peak_gib']:.1f}",
                "last loss": cell(entry["last_loss"], 1, ".4f"),
                "runs": f"{entry['runs']} × {results['timed_steps']} steps",
            }
        )
    return rows


def report(results: dict[str, Any], write_table: bool) -> str:
    """The table of ``results`` as markdown (recorded in benchmarks/ if asked)."""
    rows = table_rows(results)
    with tempfile.TemporaryDirectory() as scratch:
        tables.store("hf", rows, results["run"], Path(scratch))
        text = f"{tables.markdown('hf', Path(scratch))}\n{LEGEND}\n"
    if write_table:
        tables.record("hf", rows, results["run"])
    return text


# -- main ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-dense")
    parser.add_argument("--tiny", action="store_true", help="a tiny config of --model (CPU test)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (bytes)")
    parser.add_argument("--steps", type=int, default=15, help="steps per run")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of medians")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help=f"from {', '.join(VARIANTS)}, a Muon variant + {BF16_MOMENTUM} (bf16 momenta); "
        "dion with --dion",
    )
    parser.add_argument(
        "--momentum-dtype",
        nargs="+",
        choices=list(MOMENTUM_DTYPES),
        default=["fp32"],
        help="run each Muon variant of --variants with each of these momentum dtypes, side by "
        "side in every round: fp32 (Muon's default on these fp32 master weights) and bf16 "
        f"(as the variant + {BF16_MOMENTUM}: momentum_dtype='bf16')",
    )
    parser.add_argument("--dion", type=Path, help="a microsoft/dion checkout: adds 'dion'")
    parser.add_argument("--data", type=Path, help="a file whose bytes are the text")
    parser.add_argument("--json", type=Path, help="write every number here (rank 0)")
    parser.add_argument("--from-json", type=Path, help="report a finished run again")
    parser.add_argument("--write-table", action="store_true", help=tables.WRITE_TABLE_HELP)
    args = parser.parse_args(argv)
    if args.from_json is None:
        if args.dion is not None and "dion" not in args.variants:
            args.variants.append("dion")
        known = {*VARIANTS, *(["dion"] if args.dion is not None else [])}
        known |= {v + BF16_MOMENTUM for v in MUON_VARIANTS}
        unknown = [v for v in args.variants if v not in known]
        if unknown or len(set(args.variants)) != len(args.variants):
            parser.error(f"--variants must be distinct, from {sorted(known)}; got {unknown}")
        args.variants = with_momentum_dtypes(args.variants, args.momentum_dtype)
        if not 0 <= args.skip < args.steps or args.repeats < 1:
            parser.error("need 0 <= --skip < --steps and --repeats >= 1")
        if args.batch < 1 or args.seq < 1:
            parser.error(f"--batch ({args.batch}) and --seq ({args.seq}) must be at least 1")
    return args


def with_momentum_dtypes(variants: Sequence[str], dtypes: Sequence[str]) -> list[str]:
    """``variants`` with each Muon variant run once per momentum dtype of ``dtypes`` (in
    that order, next to each other), the others as they are; each variant once."""
    out: list[str] = []
    for variant in variants:
        if variant in MUON_VARIANTS:
            out += [variant + MOMENTUM_DTYPES[dtype] for dtype in dtypes]
        else:
            out.append(variant)
    return list(dict.fromkeys(out))


def benchmark(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run every variant in rounds; the results on rank 0 (None on the others)."""
    command = tables.command_line()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide among the {world} ranks")
    mesh = init_device_mesh(device.type, (world,))
    data = ByteData(args.data, args.batch // world, args.seq, rank)
    runs: list[dict[str, Any]] = []
    failed: dict[str, str] = {}  # the rival's variant where it does not run on this model
    begin = time.perf_counter()
    for round_ in range(args.repeats):
        for variant in args.variants:
            if variant in failed:
                continue
            try:
                run = train_run(variant, args, device, mesh, data)
            except Exception as exc:
                if variant != "dion":
                    raise
                failed[variant] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                del exc  # its traceback holds the run's model and optimizer
                free(device)
                if rank == 0:
                    print(f"{variant} does not run here, left out: {failed[variant]}", flush=True)
                continue
            runs.append({"round": round_, "variant": variant, **run})
            if rank == 0:
                median = statistics.median(run["step_s"][args.skip :]) * 1e3
                peak = "-" if run["peak_gib"] is None else f"{run['peak_gib']:.1f}"
                print(
                    f"[{time.perf_counter() - begin:6.1f} s] round {round_ + 1} {variant}: "
                    f"{median:.1f} ms/step, peak {peak} GiB, "
                    f"loss {run['last_loss']:.3f}" + (f" ({run['note']})" if run["note"] else ""),
                    flush=True,
                )
            if not math.isfinite(run["last_loss"]):
                raise SystemExit(f"{variant}: loss {run['last_loss']} after {args.steps} steps")
    params = f"{runs[0]['params'] / 1e6:.0f}M"
    label = MODELS[args.model].label.format(params=params)
    results = {
        "model": args.model,
        "label": f"{args.model} (tiny, {runs[0]['params']:,} parameters)" if args.tiny else label,
        "world_size": world,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "skip": args.skip,
        "timed_steps": args.steps - args.skip,
        "variants": list(args.variants),
        "failed": failed,
        "run": tables.run_info(gpus=world, command=command),
        "runs": runs,
        "summary": summarize(runs, args.skip, args.batch * args.seq),
    }
    dist.destroy_process_group()
    return results if rank == 0 else None


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        keys = ("label", "world_size", "batch", "seq", "skip", "timed_steps", "runs", "run")
        results = tables.read_results(args.from_json, "bench_hf.py", keys)
        tokens = results["batch"] * results["seq"]
        results["summary"] = summarize(results["runs"], results["skip"], tokens)
        print(report(results, args.write_table), end="")
        return
    results = benchmark(args)
    if results is None:
        return
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    print(report(results, args.write_table), end="")


if __name__ == "__main__":
    main()
