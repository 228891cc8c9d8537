"""A small Llama-style decoder in plain torch, with an optional mixture-of-experts MLP.

Names follow the Llama reference code (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1``, ``norm``, ``output``) because ``muon_dist.param_groups`` routes by name:
the embedding and the ``output`` head go to AdamW, hidden matrices to Muon. In the MoE
variant every expert projection is ONE 3-D parameter ``[E, out, in]`` under a module named
``experts``, so the router sees ``...experts.w1`` and orthogonalizes each expert's matrix on
its own (per-expert learning-rate scale), the way a single-device Muon would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    """Shape of the decoder; the MoE fields only matter with ``moe=True``."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    hidden_dim: int | None = None
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_embeddings: bool = True
    moe: bool = False
    n_experts: int = 4
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")
        if self.moe and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, n_experts={self.n_experts}]")
        if self.hidden_dim is None:
            # Llama's SwiGLU width: 2/3 of 4*dim, rounded up to a multiple of 32.
            self.hidden_dim = 32 * math.ceil(int(8 * self.dim / 3) / 32)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (computed in fp32 for stability)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq_len, head_dim // 2]`` of the rotary position embedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head of ``x`` ``[B, T, H, D]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions, via SDPA."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        # QK-clip reads the pre-softmax logits through this probe (a forward hook on it);
        # SDPA never materialises them, so they are computed only while tracking is on.
        self.logit_probe = nn.Identity()
        self.track_logits = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.track_logits:
            with torch.no_grad():
                logits = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(self.head_dim)
                causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                self.logit_probe(logits.masked_fill(~causal, float("-inf")))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GatherRows(torch.autograd.Function):
    """All-gather along dim 0; the backward sums every rank's gradient for this rank's rows.

    (torch.distributed.nn's all_gather backward scatters with global ranks, which breaks on
    gloo subgroups; an all-reduce of the full gradient works on every backend.)
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        rows = total.size(0) // dist.get_world_size(ctx.group)
        start = dist.get_rank(ctx.group) * rows
        return total[start : start + rows], None


class Experts(nn.Module):
    """``E`` SwiGLU experts stored as three 3-D stacks, one ``[E, out, in]`` per projection.

    A stack (rather than E separate Linears) is what large MoE codes shard along the expert
    dim and what ``muon_dist`` treats as E independent matrices.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.ep_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None

    def expert_parallel(self, ep_group: dist.ProcessGroup, dp_group: dist.ProcessGroup) -> None:
        """Switch to expert parallelism once the stacks hold only this rank's experts.

        Tokens of the EP group are all-gathered, each rank applies its experts, and the
        partial outputs are summed back; a hook sums expert gradients over the replicas.
        """
        self.ep_group, self.dp_group = ep_group, dp_group
        for weight in (self.w1, self.w2, self.w3):
            weight.register_post_accumulate_grad_hook(self._sum_over_replicas)

    def _sum_over_replicas(self, weight: torch.Tensor) -> None:
        # Each replica saw its own EP group's tokens; the global-batch gradient is their sum
        # over the world's ranks, whose per-rank losses were scaled by the world size.
        grad = weight.grad.to_local()
        dist.all_reduce(grad, group=self.dp_group)
        grad.div_(dist.get_world_size())

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Index-based dispatch: each expert runs on exactly the tokens routed to it.

        ``x`` is ``[N, dim]``, ``expert_ids`` and ``weights`` ``[N, top_k]``. Experts that
        get no token are skipped; their gradient slices stay zero, which is exact.
        """
        if self.ep_group is None:
            return self._apply_experts(x, expert_ids, weights, self.w1, self.w2, self.w3, 0)
        group, count = self.ep_group, dist.get_world_size(self.ep_group)
        local = [w.to_local().to(x.dtype) for w in (self.w1, self.w2, self.w3)]
        first = dist.get_rank(group) * local[0].size(0)
        xs = GatherRows.apply(x, group)
        gathered_ids = [torch.empty_like(expert_ids) for _ in range(count)]
        dist.all_gather(gathered_ids, expert_ids, group=group)
        ws = GatherRows.apply(weights, group)
        partial = self._apply_experts(xs, torch.cat(gathered_ids), ws, *local, first)
        total = dist_nn.all_reduce(partial, group=group)
        rank = dist.get_rank(group)
        return total[rank * x.size(0) : (rank + 1) * x.size(0)]

    @staticmethod
    def _apply_experts(
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        first: int,
    ) -> torch.Tensor:
        """Experts ``first .. first + len(w1)`` applied to the tokens routed to them."""
        out = torch.zeros_like(x)
        for local_index in range(w1.size(0)):
            token, slot = torch.where(expert_ids == first + local_index)
            if token.numel() == 0:
                continue
            h = x[token]
            y = F.silu(h @ w1[local_index].T) * (h @ w3[local_index].T)
            y = (y @ w2[local_index].T) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class MoE(nn.Module):
    """Top-k routed mixture of experts (softmax over the k selected router logits)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.hidden_dim is not None
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = Experts(args.n_experts, args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        top_logits, expert_ids = logits.topk(self.top_k, dim=-1)
        weights = top_logits.float().softmax(dim=-1).type_as(flat)
        return self.experts(flat, expert_ids, weights).view(shape)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then (dense or MoE) MLP. The unit of FSDP sharding."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.hidden_dim is not None
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(args) if args.moe else FeedForward(args.dim, args.hidden_dim)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embedding, N blocks, final norm and an ``output`` head.

    The head shares the embedding matrix by default (as small Llama models do). Tying also
    makes the example a fair optimizer test: an untied embedding→head path alone can fit
    most of a first-order Markov chain, leaving the hidden matrices (what Muon updates)
    little to do, while a tied one (``E Eᵀ``, symmetric) cannot, so the blocks must learn
    the asymmetric transition map.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2/Llama-style init; residual output projections shrink with depth."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if p.ndim < 2:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for tokens ``[B, T]`` (causal)."""
        t = tokens.size(1)
        if t > self.args.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
