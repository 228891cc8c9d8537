"""Train a small Llama-style model with FSDP2 and muon_dist.Muon (or AdamW, or both).

Launch::

    torchrun --standalone --nproc-per-node 2 examples/train.py            # one machine
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 examples/train.py                       # several machines
    python examples/train.py                                             # one process

It is the end-to-end check of the library: every parameter is a DTensor sharded by
``fully_shard`` (FSDP over all ranks, or HSDP with ``--replicate``), the optimizer step is
muon_dist's gather / orthogonalize / scatter, checkpoints go through
``torch.distributed.checkpoint`` and can be resumed on a different number of ranks. The
data is a synthetic Markov chain (see ``data.py``) whose entropy rate is the true loss
floor, so "did it learn?" has a number to compare against; ``--data`` trains on real text
instead (token shards or any files read as bytes, see ``corpus.py``) with an eval loss on
held-out tokens. GPUs and NCCL are used when present, CPUs and gloo otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkpoint import load_latest, save_checkpoint
from corpus import Corpus, open_corpus
from data import ChainStats, MarkovChain, rank_slice
from defaults import DEFAULT_ADJUST_LR, MARKOV, TEXT, swept_for
from model import Attention, ModelArgs, Transformer
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import muon_dist

# "muon", "normuon" and "dion2" are muon_dist.Muon under that update rule (AdamW for the rest).
OPTIMIZERS = ("muon", "normuon", "dion2", "adamw")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, in sequences")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="ignored with --compare")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="Muon lr (hidden matrices), any width (default: swept, see defaults.py; on the"
        " Markov chain "
        + ", ".join(f"{lr:g} with {adjust}" for adjust, lr in MARKOV.muon.items())
        + "; with --data "
        + ", ".join(f"{lr:g} with {adjust}" for adjust, lr in TEXT.muon.items())
        + ")",
    )
    p.add_argument(
        "--adjust-lr",
        choices=tuple(MARKOV.muon),  # the adjust_lr values with a swept lr
        default=DEFAULT_ADJUST_LR,
        help="Muon's adjust_lr: how each matrix's lr scales with its shape (spectral_norm:"
        " sqrt(max(1, out/in)); rms_norm: 0.2 sqrt(max(out, in)), AdamW's update RMS)",
    )
    p.add_argument(
        "--muon-adamw-lr",
        type=float,
        default=None,
        help="lr of Muon's AdamW part (embeddings, head, norms), not scaled with --dim"
        f" (default: {MARKOV.muon_adamw:g} on the Markov chain, {TEXT.muon_adamw:g} with --data)",
    )
    p.add_argument(
        "--adamw-lr",
        type=float,
        default=None,
        help=f"lr of --optimizer adamw (default: {MARKOV.adamw:g} x min(1, {MARKOV.adamw_dim} /"
        f" --dim) on the Markov chain, {TEXT.adamw:g} with --data)",
    )
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="linear lr warmup steps (default: swept per optimizer, see defaults.py; on the"
        f" Markov chain {MARKOV.muon_warmup} for Muon and {MARKOV.adamw_warmup} for AdamW; with"
        f" --data {TEXT.muon_warmup} and {TEXT.adamw_warmup})",
    )
    p.add_argument(
        "--cooldown",
        type=float,
        default=0.2,
        help="fraction of --steps at the end over which the lr decays linearly to 0",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the Markov chain, data and init")
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="train on these files instead of the Markov chain: a path or a glob (quote it);"
        " .bin token shards (llm.c / modded-nanogpt layout) or any other files read as bytes"
        " (byte-level, vocabulary 256), concatenated in sorted order",
    )
    p.add_argument(
        "--eval-data",
        default=None,
        metavar="PATH",
        help="held-out files for the eval loss (path or glob, same kind as --data; default:"
        " the last --eval-fraction of --data's tokens)",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=None,
        help="share of --data's tokens held out for the eval loss when there is no --eval-data"
        " (default 0.05)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        metavar="N",
        help="eval loss on the held-out tokens every N steps and at the last step, logged as"
        " eval_loss (default with --data: --steps / 10)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        help="batches of --batch-size sequences per eval, fixed windows the same in every run",
    )
    p.add_argument("--comm-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument(
        "--ns-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="Newton-Schulz precision; fp32 makes runs on different world sizes agree closely",
    )
    p.add_argument(
        "--momentum-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="Muon(momentum_dtype=...): fp32 (the default: the fp32 parameters' own dtype) or"
        " bf16 (half the momenta's memory, the arithmetic still fp32)",
    )
    p.add_argument("--out", type=Path, default=Path("out"), help="metrics.jsonl and loss.png")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="checkpoint period in steps (0: off); multi-node runs need a shared --ckpt-dir",
    )
    p.add_argument(
        "--ckpt-dir", type=Path, default=None, help="DCP checkpoints (default: OUT/checkpoints)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="exit after this step as if preempted (the lr schedule still spans --steps)",
    )
    p.add_argument("--save-final", type=Path, default=None, help="torch.save the full model")
    p.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share the embedding matrix with the output head",
    )
    p.add_argument("--moe", action="store_true", help="mixture-of-experts MLPs")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree for --moe: experts split over EP groups of this many ranks",
    )
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicas R, mesh (R, world / R)")
    p.add_argument(
        "--compare",
        nargs="*",
        choices=OPTIMIZERS,
        default=None,
        metavar="OPTIMIZER",
        help=f"run these optimizers one after another, plot them together (none named: all of"
        f" {', '.join(OPTIMIZERS)})",
    )
    p.add_argument(
        "--qk-clip",
        type=float,
        default=None,
        metavar="TAU",
        help="MuonClip: rescale query/key heads whose max attention logit exceeds TAU",
    )
    p.add_argument(
        "--cuda-graph",
        choices=("auto", "on", "off"),
        default="auto",
        help="Muon(cuda_graph=...): 'auto' (the default, as Muon's) captures the optimizer "
        "step in a CUDA graph where the job allows (CUDA, no --overlap), 'on' always, 'off' "
        "never",
    )
    p.add_argument(
        "--overlap",
        choices=("none", "backward", "auto"),
        default="none",
        help="Muon(overlap=...): 'backward' starts Newton-Schulz during backward, 'auto' times "
        "both modes over its first steps and keeps the faster",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="no loss.png (drawing it takes seconds of matplotlib; metrics.jsonl has the numbers)",
    )
    args = p.parse_args(argv)
    swept = swept_for(args.data)
    if args.lr is None:
        args.lr = swept.muon[args.adjust_lr]
    if args.muon_adamw_lr is None:
        args.muon_adamw_lr = swept.muon_adamw
    if args.adamw_lr is None:
        args.adamw_lr = swept.adamw_at(args.dim)
    if args.compare is not None:
        # In the order given, each once; a bare --compare runs them all.
        args.compare = list(dict.fromkeys(args.compare)) or list(OPTIMIZERS)
    if args.ckpt_dir is None:
        args.ckpt_dir = args.out / "checkpoints"
    if args.ep < 1:
        p.error("--ep must be >= 1")
    if args.ep > 1 and not args.moe:
        p.error("--ep needs --moe: only expert stacks are expert-parallel")
    if args.ep > 1 and args.replicate > 1:
        p.error("--ep and --replicate cannot be combined in this example")
    if args.ep > 1 and args.experts % args.ep:
        p.error(f"--experts {args.experts} must be divisible by --ep {args.ep}")
    if args.replicate < 1:
        p.error("--replicate must be >= 1")
    if args.stop_after is not None and not 0 < args.stop_after <= args.steps:
        p.error("--stop-after must lie in [1, --steps]")
    if args.data is None:
        for flag in ("eval_data", "eval_fraction", "eval_every"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} needs --data: it evaluates held-out text")
    else:
        if args.eval_data is not None and args.eval_fraction is not None:
            p.error("--eval-fraction splits --data; it cannot be combined with --eval-data")
        if args.eval_fraction is None:
            args.eval_fraction = 0.05
        if args.eval_every is None:
            args.eval_every = max(1, args.steps // 10)
        if args.eval_every < 1:
            p.error(f"--eval-every {args.eval_every} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup {args.warmup} must be >= 0 (0: no warmup)")
    if args.eval_batches < 1:
        p.error(f"--eval-batches {args.eval_batches} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------
# Distributed setup


@dataclass(frozen=True)
class Env:
    """Where this process runs: its global rank, the world size and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Env:
    """Join torchrun's process group, or make a one-process group when run directly.

    FSDP2 and DCP need a process group even on one rank; a ``HashStore`` gives one without
    picking a port. GPU runs use NCCL on ``cuda:LOCAL_RANK`` (torchrun's per-node index,
    so nothing here depends on the node); CPU runs use gloo. Under torchrun the group's
    keys live under a prefix of their own per restart attempt (:func:`attempt_store`).
    """
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = attempt_store()
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            device_id=device if use_cuda else None,
        )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Env(dist.get_rank(), dist.get_world_size(), device)


def attempt_store() -> tuple[dist.Store, int, int]:
    """torchrun's store seen through a prefix naming this restart attempt, with the rank
    and world size.

    ``torchrun --max-restarts N`` starts every worker again after one dies, against the
    store the last attempt used: its keys still hold each old rank's address, and the new
    group's gloo or NCCL mesh would dial the dead worker's address instead of waiting for
    the new one. Keys under ``attempt_<TORCHELASTIC_RESTART_COUNT>/`` are this attempt's
    only.
    """
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt_{attempt}/", store), rank, world_size


def build_mesh(env: Env, replicate: int) -> DeviceMesh:
    """1-D FSDP mesh over all ranks, or a 2-D HSDP mesh ("replicate", "shard")."""
    if replicate == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
    if env.world_size % replicate:
        raise SystemExit(f"--replicate {replicate} does not divide the {env.world_size} ranks")
    shape = (replicate, env.world_size // replicate)
    return init_device_mesh(env.device.type, shape, mesh_dim_names=("replicate", "shard"))


def model_args(args: argparse.Namespace) -> ModelArgs:
    """The model's shape from the flags (benchmarks/sweep.py counts its parameters)."""
    return ModelArgs(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.seq_len,
        tie_embeddings=args.tie_embeddings,
        moe=args.moe,
        n_experts=args.experts,
        top_k=args.top_k,
    )


def build_model(args: argparse.Namespace, mesh: DeviceMesh, env: Env) -> Transformer:
    """Same seeded init on every rank, then ``fully_shard`` each block and the root.

    Sharding per block lets FSDP gather one block's weights at a time; the root call takes
    the embedding, final norm and head. On GPU the forward runs in bf16 with fp32 gradient
    reduction; on CPU everything stays fp32.
    """
    torch.manual_seed(args.seed + 1)
    model = Transformer(model_args(args)).to(env.device)
    if args.ep > 1 and args.batch_size % env.world_size:
        raise SystemExit(
            f"--ep needs --batch-size divisible by the {env.world_size} ranks: EP groups "
            "exchange equal-sized token blocks"
        )
    experts = distribute_experts(model, args.ep, env)
    mp = None
    if env.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "ignored_params": experts}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def distribute_experts(model: Transformer, ep: int, env: Env) -> set[nn.Parameter]:
    """Expert parallelism: each EP group of ``ep`` ranks splits every expert stack.

    The stacks become DTensors ``(Replicate(), Shard(0))`` on a ("dp", "ep") mesh: whole
    experts live on one rank of each EP group, replicated across groups. FSDP leaves them
    alone (they are returned as its ignored parameters); muon_dist sees whole local
    matrices and splits their Newton–Schulz work across the replicas.
    """
    if ep == 1:
        return set()
    if env.world_size % ep:
        raise SystemExit(f"--ep {ep} does not divide the {env.world_size} ranks")
    mesh = init_device_mesh(
        env.device.type, (env.world_size // ep, ep), mesh_dim_names=("dp", "ep")
    )
    params: set[nn.Parameter] = set()
    for block in model.layers:
        experts = block.feed_forward.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name).detach()
            shard = nn.Parameter(distribute_tensor(full, mesh, [Replicate(), Shard(0)]))
            setattr(experts, name, shard)
            params.add(shard)
        experts.expert_parallel(mesh.get_group("ep"), mesh.get_group("dp"))
    return params


def qk_clip_options(model: nn.Module, tau: float | None) -> dict[str, Any]:
    """MuonClip on every attention layer: a logit tracker hooked to each layer's probe."""
    if tau is None:
        return {}
    tracker = muon_dist.MaxLogitTracker()
    layers = []
    for index, block in enumerate(model.layers):
        prefix = f"layers.{index}.attention"
        block.attention.track_logits = True
        tracker.attach(block.attention.logit_probe, prefix)
        layers.append(
            muon_dist.QKClip(
                prefix,
                query=f"{prefix}.wq.weight",
                key=f"{prefix}.wk.weight",
                num_heads=block.attention.n_heads,
                tau=tau,
            )
        )
    return {"qk_clip": layers, "max_logits": tracker}


def build_optimizer(name: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Muon, NorMuon or Dion2 (hidden matrices) + AdamW (the rest) via muon_dist, or plain
    AdamW everywhere."""
    betas = (0.9, 0.95)
    if name != "adamw":
        groups = muon_dist.param_groups(
            model,
            lr=args.lr,
            adamw_lr=args.muon_adamw_lr,
            weight_decay=args.weight_decay,
            adamw_betas=betas,
        )
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        return muon_dist.Muon(
            groups,
            lr=args.lr,
            adamw_lr=args.muon_adamw_lr,
            adjust_lr=args.adjust_lr,
            comm_dtype=dtypes[args.comm_dtype],
            ns_dtype=dtypes[args.ns_dtype],
            cuda_graph={"auto": "auto", "on": True, "off": False}[args.cuda_graph],
            rule=name,
            overlap=args.overlap,
            # fp32 is Muon's default here (None: the parameters' dtype), so checkpoints of
            # runs from before the option load without a conversion.
            momentum_dtype={"fp32": None, "bf16": "bf16"}[args.momentum_dtype],
            **qk_clip_options(model, args.qk_clip),
        )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.adamw_lr,
        betas=betas,
    )


def lr_factor(step: int, args: argparse.Namespace, warmup: int) -> float:
    """Warmup, constant, then linear cooldown to 0 (a "WSD" schedule) for step 1..steps."""
    if warmup > 0 and step <= warmup:
        return step / warmup
    cooldown = int(args.cooldown * args.steps)
    if cooldown > 0 and step > args.steps - cooldown:
        return max(0.0, (args.steps - step + 1) / (cooldown + 1))
    return 1.0


# ---------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_dir(args: argparse.Namespace, optimizer: str) -> Path:
    """Per-optimizer subfolder with --compare so the two runs never mix states."""
    return args.ckpt_dir / optimizer if args.compare else args.ckpt_dir


# ---------------------------------------------------------------------------------------
# Metrics and plot


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trim_metrics(path: Path, optimizer: str, keep_through: int) -> None:
    """Drop this optimizer's lines after ``keep_through`` so a resumed log has no repeats."""
    rows = [
        r for r in read_metrics(path) if r["optimizer"] != optimizer or r["step"] <= keep_through
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot(out: Path, stats: ChainStats | None, title: str) -> Path | None:
    """loss.png: loss vs step and vs wall time per optimizer; for the Markov chain with both
    entropy references, for ``--data`` with the eval loss on held-out tokens.

    matplotlib is optional (``pip install -e '.[examples]'``): training needs none of it.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no loss.png (metrics.jsonl has the numbers)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(out / "metrics.jsonl")
    # Top row: the loss itself (and the eval loss). Bottom row, Markov chain only: the excess
    # over the floor on a log scale, smoothed, where optimizers that all end near it differ.
    if stats is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    else:
        fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    for name in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == name]
        if mine:
            _plot_curves(axes, name, mine, stats)
    _label_panels(axes, stats)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_curves(
    axes: Any, name: str, rows: list[dict[str, Any]], stats: ChainStats | None
) -> None:
    """One optimizer's curves in each column (x: step, then wall time): its loss, its eval
    loss in the same colour, and on the Markov chain its smoothed excess over the floor.

    ``axes`` is the figure's 2-D array of matplotlib Axes (rows: panels; columns: x axes).
    """
    losses = [r["loss"] for r in rows]
    evals = [r for r in rows if "eval_loss" in r]
    for col, key in enumerate(("step", "elapsed")):
        x = [r[key] for r in rows]
        (line,) = axes[0, col].plot(x, losses, label=name, lw=1)
        if evals:
            axes[0, col].plot(
                [r[key] for r in evals],
                [r["eval_loss"] for r in evals],
                "o--",
                c=line.get_color(),
                ms=4,
                label=f"{name} eval (held out)",
            )
        if stats is not None:
            excess = _moving_average([loss - stats.entropy_rate for loss in losses], 10)
            axes[1, col].plot(x, excess, label=name, lw=1.2)


def _label_panels(axes: Any, stats: ChainStats | None) -> None:
    """Axis labels, grids and legends, and on the Markov chain the entropy references the
    losses are read against (drawn after the curves, so the legends list them last)."""
    for col, xlabel in enumerate(("step", "wall time (s)")):
        top = axes[0, col]
        top.set_ylabel("loss (nats/token)")
        panels = [top]
        if stats is None:
            top.set_xlabel(xlabel)
        else:
            bottom = axes[1, col]
            top.axhline(stats.unigram_entropy, ls="--", c="gray", label="unigram entropy")
            top.axhline(stats.entropy_rate, ls=":", c="black", label="entropy rate (floor)")
            bottom.axhline(
                stats.unigram_entropy - stats.entropy_rate,
                ls="--",
                c="gray",
                label="unigram entropy",
            )
            bottom.set_yscale("log")
            bottom.set_ylabel("loss - entropy rate (10-step mean)")
            bottom.set_xlabel(xlabel)
            panels.append(bottom)
        for ax in panels:
            ax.grid(alpha=0.3, which="both")
            ax.legend()


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# ---------------------------------------------------------------------------------------
# Timing and data


PREFETCH = 4
"""Batches built ahead of the step: a batch that once takes longer than a step to build is
absorbed by the ones already waiting."""


def prefetched(
    make: Callable[[int], torch.Tensor],
    steps: range,
    device: torch.device,
    depth: int = PREFETCH,
) -> Iterator[tuple[int, torch.Tensor, float]]:
    """``(step, batch on device, seconds waited for it)`` for each of ``steps``, in order.

    ``make(step)`` runs on a background thread up to ``depth`` steps ahead: batches are built
    while the steps train, so a step waits only when building has fallen ``depth`` batches
    behind (the wait says how long). Batches are a pure function of the step, so the
    numbers are those of building each batch inline. On CUDA the thread pins the batch and
    the copy to the device does not block the host.
    """
    if depth < 1:
        raise ValueError(f"depth {depth} must be >= 1: the batch after the current one")
    cuda = device.type == "cuda"

    def build(step: int) -> torch.Tensor:
        batch = make(step)
        return batch.pin_memory() if cuda else batch

    # A new thread's current CUDA device is 0: pinning there would open a context on GPU 0
    # from every rank, so the thread takes this rank's device first.
    setup: dict[str, Any] = {"initializer": torch.cuda.set_device, "initargs": (device,)}
    pool = ThreadPoolExecutor(1, thread_name_prefix="batches", **(setup if cuda else {}))
    try:
        futures = (pool.submit(build, step) for step in steps)
        ahead = deque(islice(futures, depth))
        for step in steps:
            current = ahead.popleft()
            ahead.extend(islice(futures, 1))
            begin = time.perf_counter()
            batch = current.result()
            waited = time.perf_counter() - begin
            yield step, batch.to(device, non_blocking=True), waited
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def agree_to_go_on(error: str | None, device: torch.device) -> None:
    """Go on on every rank, or raise on every rank with each rank's ``error``.

    A rank's batch can fail alone (its rows touch a ``--data`` file that shrank, or a token
    outside ``--vocab``); raising there alone would leave the other ranks waiting in their
    next collective. One small all-reduce, before the step's clock starts, lets every rank
    stop with the same message.
    """
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise RuntimeError("; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))


def agreed(
    batches: Iterator[tuple[int, torch.Tensor, float]], device: torch.device
) -> Iterator[tuple[int, torch.Tensor, float]]:
    """``batches``, with every rank stopping together where one rank's batch failed."""
    while True:
        error, item = None, None
        try:
            item = next(batches)
        except StopIteration:
            return
        except (ValueError, RuntimeError, OSError) as exc:
            error = str(exc)
        agree_to_go_on(error, device)
        assert item is not None
        yield item


@dataclass(frozen=True)
class StepTimes:
    """One step's phases in seconds, each the slowest rank's (see ``StepTimer``)."""

    data_wait: float
    """Waiting for the prefetched batch, before the common start (not part of ``step``)."""
    fwd_bwd: float
    """Common start to the end of backward (its last gradient reduction included)."""
    opt: float
    """The optimizer's exposed time: end of backward to end of ``step()`` and ``zero_grad``."""
    step: float
    """Common start to the end of the step; at most ``fwd_bwd + opt`` (each is a maximum)."""


class StepTimer:
    """Times a step's phases from a common start, as the slowest rank sees them.

    ``start`` waits at a barrier, and for the device, before the clock starts, so every
    rank's phases begin together: a rank that reaches the step late (its batch, its logging)
    waits there, outside the timed phases, rather than inside another rank's forward at
    FSDP's first all-gather. On CUDA the end of backward is an event on the current stream,
    so the host is not held between backward and the optimizer (it queues the step while
    backward runs, as it does untimed); ``stop`` waits for the device once, after the step.
    ``slowest`` then takes each phase's maximum over the ranks in one small all-reduce, also
    outside the timed phases: a step is as slow as its slowest rank.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._backward_event = torch.cuda.Event(enable_timing=True)
        self._start = self._backward = self._stop = 0.0

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)

    def start(self) -> None:
        """Barrier, then the clock starts (after this rank's queued work has finished)."""
        dist.barrier()
        self._synchronize()
        self._start = time.perf_counter()
        if self._cuda:
            self._start_event.record()

    def backward_done(self) -> None:
        if self._cuda:
            self._backward_event.record()
        else:
            self._backward = time.perf_counter()

    def stop(self) -> None:
        """The clock stops when the host has returned and the device has finished."""
        self._synchronize()
        self._stop = time.perf_counter()

    def slowest(self, data_wait: float) -> StepTimes:
        """This step's phases, each the maximum over ranks (one all-reduce, every rank)."""
        total = self._stop - self._start
        if self._cuda:
            fwd_bwd = self._start_event.elapsed_time(self._backward_event) / 1e3
        else:
            fwd_bwd = self._backward - self._start
        local = [data_wait, fwd_bwd, total - fwd_bwd, total]
        times = torch.tensor(local, dtype=torch.float64, device=self._device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return StepTimes(*times.tolist())


# ---------------------------------------------------------------------------------------
# Training


@contextmanager
def progress(total: int, initial: int, enabled: bool) -> Iterator[Any]:
    """A tqdm bar on rank 0, or None (tqdm is optional: without it, log lines instead)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield None
        return

    bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")
    try:
        yield bar
    finally:
        bar.close()


def log(env: Env, message: str) -> None:
    if env.is_main:
        print(message, flush=True)


def local_batch(
    data: MarkovChain | Corpus, step: int, args: argparse.Namespace, rows: slice
) -> torch.Tensor:
    """This rank's ``rows`` of the global batch of ``step``, built by this rank alone."""
    if isinstance(data, Corpus):
        return torch.from_numpy(data.batch(step, args.batch_size, rows))
    return data.batch(step, args.batch_size, args.seq_len, rows)


@contextmanager
def logits_untracked(model: nn.Module) -> Iterator[None]:
    """No QK-clip logit tracking inside: an eval forward must not feed the next clip."""
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    saved = [m.track_logits for m in attention]
    for m in attention:
        m.track_logits = False
    try:
        yield
    finally:
        for m, flag in zip(attention, saved, strict=True):
            m.track_logits = flag


def evaluate(
    model: nn.Module, corpus: Corpus, args: argparse.Namespace, env: Env, rows: slice
) -> float:
    """Mean loss per token on the fixed held-out windows, each rank its rows of each batch."""
    total = torch.zeros((), device=env.device)
    batches, error = [], None
    try:
        for index in range(args.eval_batches):
            batches.append(corpus.eval_batch(index, args.batch_size, rows, args.eval_batches))
    except (ValueError, RuntimeError, OSError) as exc:
        error = str(exc)
    agree_to_go_on(error, env.device)
    with torch.no_grad(), logits_untracked(model):
        for windows in batches:
            batch = torch.from_numpy(windows).to(env.device, non_blocking=True)
            logits = model(batch[:, :-1])
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
            )
    # The root module keeps its parameters gathered after a forward (for the backward that
    # usually follows); give the memory back, as a training step does.
    cast(FSDPModule, model).reshard()
    dist.all_reduce(total)
    tokens: int = args.eval_batches * args.batch_size * args.seq_len
    return float(total.item()) / tokens


def eval_due(data: MarkovChain | Corpus, step: int, args: argparse.Namespace) -> bool:
    """With ``--data``: every ``--eval-every`` steps and at the last."""
    return isinstance(data, Corpus) and (step % args.eval_every == 0 or step == args.steps)


@dataclass
class Run:
    """One optimizer's run as set up: what its steps share, and what they carry along.

    Each part of the loop in :func:`train` (the step, its report, its checkpoint) is a
    function of this, so the loop itself stays the few lines a user writes.
    """

    name: str
    args: argparse.Namespace
    env: Env
    data: MarkovChain | Corpus
    model: Transformer
    opt: torch.optim.Optimizer
    base_lrs: list[float]
    """Each param group's lr at the schedule's peak: a step's lr is this times its factor."""
    warmup: int
    rows: slice
    """This rank's rows of every global batch."""
    ckpt_root: Path
    choosing: bool
    """``overlap="auto"`` is still measuring: its choice is shown once, when made."""
    start: int
    """The last step already trained (the resumed checkpoint's), 0 for a fresh run."""
    elapsed: float
    """Seconds of steps so far, a resumed run's included: the metrics' wall time."""

    @property
    def global_tokens(self) -> int:
        """Tokens in one global batch: the loss is their mean."""
        tokens: int = self.args.batch_size * self.args.seq_len
        return tokens

    def batch_of(self, step: int) -> torch.Tensor:
        """This rank's rows of the global batch of ``step`` (built on the prefetch thread)."""
        return local_batch(self.data, step, self.args, self.rows)


def train(
    optimizer_name: str,
    args: argparse.Namespace,
    env: Env,
    mesh: DeviceMesh,
    data: MarkovChain | Corpus,
) -> list[dict[str, Any]]:
    """One full (or resumed) run with one optimizer; returns its metrics, a dict a step."""
    run = set_up(optimizer_name, args, env, mesh, data)
    end = args.stop_after or args.steps
    show = env.is_main and not args.no_progress
    records: list[dict[str, Any]] = []
    timer = StepTimer(env.device)
    batches = prefetched(run.batch_of, range(run.start + 1, end + 1), env.device)
    with progress(args.steps, run.start, show) as bar, closing(batches):
        for step, batch, data_wait in agreed(batches, env.device):
            record, times = train_step(run, timer, step, batch, data_wait)
            loss = record["loss"]
            if eval_due(data, step, args) and math.isfinite(loss):
                record["eval_loss"] = evaluate(run.model, data, args, env, run.rows)
            records.append(record)
            append_metrics(run, record)
            if not math.isfinite(loss):  # logged first: metrics.jsonl shows the divergence
                raise FloatingPointError(f"[{optimizer_name}] loss is {loss} at step {step}")
            report(run, record, times, bar, end)
            if args.ckpt_every and step % args.ckpt_every == 0:
                save_step(run, step)
    save_final(run)
    return records


def set_up(
    name: str,
    args: argparse.Namespace,
    env: Env,
    mesh: DeviceMesh,
    data: MarkovChain | Corpus,
) -> Run:
    """The sharded model and its optimizer, resumed from the latest checkpoint with
    ``--resume``: everything a run's steps need, built the same way on every rank."""
    model = build_model(args, mesh, env)
    opt = build_optimizer(name, model, args)
    base_lrs = [group["lr"] for group in opt.param_groups]
    if name != "adamw":
        log(env, "muon_dist routing table:\n" + opt.routing_table())  # type: ignore[attr-defined]
    choosing = isinstance(opt, muon_dist.Muon) and opt.overlap_mode == "measuring"
    ckpt_root = checkpoint_dir(args, name)
    start, elapsed = resume(name, args, env, model, opt, ckpt_root)
    return Run(
        name=name,
        args=args,
        env=env,
        data=data,
        model=model,
        opt=opt,
        base_lrs=base_lrs,
        warmup=swept_for(args.data).warmup(name) if args.warmup is None else args.warmup,
        rows=rank_slice(args.batch_size, env.rank, env.world_size),
        ckpt_root=ckpt_root,
        choosing=choosing,
        start=start,
        elapsed=elapsed,
    )


def resume(
    name: str,
    args: argparse.Namespace,
    env: Env,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ckpt_root: Path,
) -> tuple[int, float]:
    """With ``--resume``, the latest checkpoint's weights and optimizer state loaded; returns
    its step and clock (0, 0.0 when fresh). The run's metrics lines after that step are
    dropped so that the resumed log has no repeats."""
    start, elapsed = 0, 0.0
    latest = load_latest(ckpt_root, model, opt) if args.resume else None
    if latest is not None:
        folder, meta = latest
        start, elapsed = meta["step"], meta["elapsed"]
        log(env, f"[{name}] resumed {folder} (saved on {meta['world_size']} ranks)")
    elif args.resume:
        log(env, f"[{name}] no checkpoint in {ckpt_root}; starting from scratch")
    if env.is_main:
        trim_metrics(args.out / "metrics.jsonl", name, start)
    return start, elapsed


def train_step(
    run: Run, timer: StepTimer, step: int, batch: torch.Tensor, data_wait: float
) -> tuple[dict[str, Any], StepTimes]:
    """Step ``step`` at its scheduled lr, timed; returns its metrics record and its times.

    Every rank all-reduces the times, then the loss, in that order, after the step's clock
    has stopped: neither is part of the timed step.
    """
    factor = lr_factor(step, run.args, run.warmup)
    for group, base in zip(run.opt.param_groups, run.base_lrs, strict=True):
        group["lr"] = base * factor
    timer.start()
    loss_sum = forward_backward(run, batch)
    timer.backward_done()
    run.opt.step()
    run.opt.zero_grad()
    timer.stop()
    times = timer.slowest(data_wait)
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    loss = total.item() / run.global_tokens
    run.elapsed += times.step
    return step_record(run, step, loss, times, factor), times


def forward_backward(run: Run, batch: torch.Tensor) -> torch.Tensor:
    """The next-token loss summed over this rank's tokens, with its gradients computed.

    FSDP averages gradients over ranks; scaling by world/global_tokens turns that average
    into the gradient of the global-batch mean whatever the rank split.
    """
    logits = run.model(batch[:, :-1])
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
    )
    (loss_sum * (run.env.world_size / run.global_tokens)).backward()
    return loss_sum


def step_record(
    run: Run, step: int, loss: float, times: StepTimes, factor: float
) -> dict[str, Any]:
    """The step's line of metrics.jsonl (``eval_loss`` is added where an eval is due)."""
    return {
        "step": step,
        "loss": loss,
        "tokens": step * run.global_tokens,
        "elapsed": run.elapsed,
        "fwd_bwd_s": times.fwd_bwd,
        "opt_s": times.opt,
        "step_s": times.step,
        "data_wait_s": times.data_wait,
        "optimizer": run.name,
        "lr_factor": factor,
        "world_size": run.env.world_size,
    }


def append_metrics(run: Run, record: dict[str, Any]) -> None:
    """Rank 0 appends the step's record as it goes: a run that stops early, or diverges,
    leaves every step it took in metrics.jsonl."""
    if run.env.is_main:
        with (run.args.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def report(run: Run, record: dict[str, Any], times: StepTimes, bar: Any, end: int) -> None:
    """The step on the progress bar (or as a log line), then what happened at it."""
    show_step(run, record, times, bar, end)
    for message in step_messages(run, record):
        if bar is not None:
            bar.write(message)
        else:
            log(run.env, message)


def show_step(run: Run, record: dict[str, Any], times: StepTimes, bar: Any, end: int) -> None:
    """Loss and speed on rank 0's progress bar; without one, a log line every tenth of
    ``--steps`` and at the last step, so that a log stays short."""
    name, step, loss = run.name, record["step"], record["loss"]
    if bar is not None:
        bar.set_postfix(
            {
                "opt": name,
                "loss": f"{loss:.3f}",
                "tok/s": f"{run.global_tokens / times.step:,.0f}",
                "step": f"{times.step * 1e3:.0f}ms",
                "fwd+bwd": f"{times.fwd_bwd * 1e3:.0f}ms",
                "optim": f"{times.opt * 1e3:.0f}ms",
            },
            refresh=False,
        )
        bar.update(1)
    elif step % max(1, run.args.steps // 10) == 0 or step == end:
        log(
            run.env,
            f"[{name}] step {step}/{run.args.steps} loss {loss:.4f} | step "
            f"{times.step * 1e3:.1f} ms (forward+backward {times.fwd_bwd * 1e3:.1f}, "
            f"optimizer {times.opt * 1e3:.1f}), {run.global_tokens / times.step:,.0f} tok/s",
        )


def step_messages(run: Run, record: dict[str, Any]) -> list[str]:
    """What a step has to say beyond its numbers: its eval loss, and ``overlap="auto"``'s
    choice at the step it is made (once a run)."""
    messages = []
    if "eval_loss" in record:
        messages.append(f"[{run.name}] step {record['step']} eval loss {record['eval_loss']:.4f}")
    opt = run.opt
    if run.choosing and isinstance(opt, muon_dist.Muon) and opt.overlap_mode != "measuring":
        run.choosing = False
        messages.append(auto_choice_line(opt, run.name, record["step"]))
    return messages


def save_step(run: Run, step: int) -> None:
    """A DCP checkpoint of ``step`` (every rank writes its shards) with what resuming needs:
    the step, the clock, and the world size it was saved on."""
    meta = {
        "step": step,
        "elapsed": run.elapsed,
        "world_size": run.env.world_size,
        "optimizer": run.name,
        "seed": run.args.seed,
    }
    save_checkpoint(run.ckpt_root / f"step_{step:06d}", run.model, run.opt, meta)


def save_final(run: Run) -> None:
    """With ``--save-final``, the full unsharded model as one ``torch.save`` file (one per
    optimizer with ``--compare``); gathering it is a collective, rank 0 writes it."""
    target = run.args.save_final
    if target is None:
        return
    if run.args.compare:
        target = target.with_name(f"{target.stem}_{run.name}{target.suffix}")
    full = get_model_state_dict(
        run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if run.env.is_main:
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(full, target)


def auto_choice_line(opt: muon_dist.Muon, name: str, step: int) -> str:
    """What ``overlap="auto"`` chose at ``step``, and the medians it chose by."""
    medians = opt.overlap_choice.medians or {}
    times = ", ".join(f"{mode} {seconds * 1e3:.1f} ms" for mode, seconds in medians.items())
    return (
        f"[{name}] step {step}: overlap='auto' chose {opt.overlap_mode!r} (median step of "
        f"each mode, the slowest rank's: {times})"
    )


def summarize(name: str, records: list[dict[str, Any]], stats: ChainStats | None, env: Env) -> None:
    """Final loss (mean of the last 10 steps, the last step alone is noisy) vs references,
    or with ``--data`` vs the last eval loss."""
    if not records:
        return
    tail = [r["loss"] for r in records[-10:]]
    final = sum(tail) / len(tail)
    summary = f"[{name}] final loss {final:.4f} (mean of last {len(tail)} steps)"
    if stats is not None:
        gap = stats.unigram_entropy - stats.entropy_rate
        learned = (stats.unigram_entropy - final) / gap
        summary += (
            f" | entropy-rate floor {stats.entropy_rate:.4f} | unigram entropy "
            f"{stats.unigram_entropy:.4f} | {100 * learned:.1f}% of the unigram-to-floor gap "
            "closed"
        )
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        summary += f" | eval loss {evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']}"
    log(env, summary)


def open_data(args: argparse.Namespace) -> tuple[MarkovChain | Corpus, ChainStats | None, str]:
    """The Markov chain, or the ``--data`` corpus: with the chain's entropy references (None
    for real text) and a line that describes it."""
    if args.data is None:
        chain = MarkovChain(args.vocab, seed=args.seed)
        stats = chain.stats()
        line = (
            f"Markov chain over {args.vocab} tokens: entropy rate {stats.entropy_rate:.4f} "
            f"nats/token, unigram entropy {stats.unigram_entropy:.4f}, uniform "
            f"{math.log(args.vocab):.4f}"
        )
        return chain, stats, line
    corpus = open_corpus(
        args.data, args.eval_data, args.eval_fraction, args.seq_len, args.vocab, args.seed
    )
    line = (
        f"data {corpus.source.describe()} for training; eval loss on "
        f"{corpus.held_out_name}, {len(corpus.held_out):,} tokens ({args.eval_batches} fixed "
        f"batches every {args.eval_every} steps)"
    )
    return corpus, None, line


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(load_latest.__module__).setLevel(logging.INFO)  # save and resume times
    env = init_distributed()
    try:
        mesh = build_mesh(env, args.replicate)
        data, stats, described = open_data(args)
        log(
            env,
            f"world {env.world_size} on {env.device.type} ({dist.get_backend()}), mesh "
            f"{dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))}; {described}",
        )
        log(
            env,
            f"lr: Muon {args.lr:g} ({args.adjust_lr}), its AdamW part {args.muon_adamw_lr:g};"
            f" AdamW {args.adamw_lr:g} (at --dim {args.dim})",
        )
        if env.is_main:
            args.out.mkdir(parents=True, exist_ok=True)
            if not args.resume:
                (args.out / "metrics.jsonl").unlink(missing_ok=True)
        if args.ckpt_every and not args.resume and any(args.ckpt_dir.glob("**/step_*")):
            # A later --resume would pick the newest step, which could be a stale one.
            raise SystemExit(
                f"{args.ckpt_dir} already holds checkpoints: pass --resume to continue from "
                "them, or remove the folder / choose another --ckpt-dir for a fresh run"
            )
        dist.barrier()
        names = args.compare if args.compare else [args.optimizer]
        results = {name: train(name, args, env, mesh, data) for name in names}
        for name, records in results.items():
            summarize(name, records, stats, env)
        if env.is_main and args.no_plot:
            log(env, f"metrics: {args.out / 'metrics.jsonl'}")
        elif env.is_main:
            if args.data is None:
                title = "Markov-chain language modelling: training loss"
            else:
                title = f"{args.data}: training loss, eval loss on held-out tokens"
            path = plot(args.out, stats, title)
            log(env, f"metrics: {args.out / 'metrics.jsonl'}; plot: {path}")
        # Leave together: a rank that tore its gloo group down while rank 0 still plotted
        # sometimes aborted at exit ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
