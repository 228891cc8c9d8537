"""QK-clip (MuonClip): rescale query and key rows per head when attention logits run away.

After each optimizer step, every attention layer whose largest pre-softmax logit ``S_h`` of
head ``h`` exceeds ``tau`` has that head's weights scaled so the same input would give a logit
of ``tau``: query and key rows by ``sqrt(tau / S_h)`` each. With grouped-query attention
(fewer key heads than query heads) a key head serves several query heads, and shrinking it
would also shrink heads that are within bounds; there the query head takes the whole factor
``tau / S_h`` and shared keys are left alone, as Kimi K2 does for its shared rotary key.
Each rank scales the rows of its own shard, wherever head boundaries fall: no gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from muon_dist.comm.groups import Peers
from muon_dist.plan.build import local_rows, placement_of
from muon_dist.plan.views import is_positive_int, matrix_view
from muon_dist.state.tensors import local


@dataclass(frozen=True)
class QKClip:
    """One attention layer to clip: where its logits are recorded, and its head layout.

    ``query`` and ``key`` name parameters as the optimizer knows them (``param_names``,
    which :func:`muon_dist.param_groups` sets). For a fused QKV weight, name it twice and
    pick the blocks with ``query_rows`` / ``key_rows`` (half-open row ranges; default: all
    rows). ``num_kv_heads`` defaults to ``num_heads``; fewer key heads means grouped-query
    attention.
    """

    layer: str
    query: str
    key: str
    num_heads: int
    num_kv_heads: int | None = None
    tau: float = 100.0
    query_rows: tuple[int, int] | None = None
    key_rows: tuple[int, int] | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads


class MaxLogitTracker:
    """Per-head maxima of pre-softmax attention logits, kept until the optimizer step.

    Record from a forward hook (:meth:`attach`) or by calling :meth:`record` in the
    attention forward; gradient accumulation and recomputation only raise the running max.
    """

    def __init__(self) -> None:
        self._max: dict[str, torch.Tensor] = {}

    def record(self, layer: str, logits: torch.Tensor) -> None:
        """Fold ``logits`` of shape ``[..., heads, q_len, k_len]`` into ``layer``'s maxima.

        Pass logits after scaling and before the softmax; masked positions should be -inf.
        """
        if logits.ndim < 3:
            raise ValueError(
                f"layer {layer!r}: logits of shape {tuple(logits.shape)}; expected "
                "[..., heads, q_len, k_len]"
            )
        dims = tuple(d for d in range(logits.ndim) if d != logits.ndim - 3)
        per_head = logits.detach().amax(dim=dims).float()
        previous = self._max.get(layer)
        self._max[layer] = per_head if previous is None else torch.maximum(previous, per_head)

    def attach(self, module: nn.Module, layer: str) -> RemovableHandle:
        """Record ``module``'s output as ``layer``'s logits on every forward.

        ``module`` is whatever returns the logits, e.g. an ``nn.Identity`` placed before the
        softmax.
        """

        def hook(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
            self.record(layer, output)

        return module.register_forward_hook(hook)

    def pop(self) -> dict[str, torch.Tensor]:
        """The maxima recorded since the last call, clearing them."""
        maxima, self._max = self._max, {}
        return maxima


@dataclass(frozen=True)
class _Block:
    """Rows ``[start, stop)`` of tensor ``tensor`` holding ``heads`` equal heads."""

    tensor: int
    start: int
    stop: int
    heads: int


class QKClipper:
    """QK-clip layers resolved against the optimizer's parameters; call it after each step."""

    def __init__(
        self,
        layers: Sequence[QKClip],
        tracker: MaxLogitTracker | None,
        named: Mapping[str, torch.Tensor],
        rank: int,
        holders: Peers,
    ) -> None:
        if not isinstance(tracker, MaxLogitTracker):
            raise TypeError(
                f"qk_clip needs max_logits=muon_dist.MaxLogitTracker(), got {tracker!r}"
            )
        self.layers = list(layers)
        self.tracker = tracker
        self.holders = holders  # the ranks whose logits are maxed together
        self.tensors: list[torch.Tensor] = []
        self.rows: list[tuple[int, int]] = []  # global rows of each tensor's local shard
        self.blocks: list[tuple[_Block, _Block]] = []
        seen: set[str] = set()
        for spec in self.layers:
            if not isinstance(spec, QKClip):
                raise TypeError(f"qk_clip entries must be muon_dist.QKClip, got {spec!r}")
            if spec.layer in seen:
                raise ValueError(f"qk_clip names layer {spec.layer!r} twice")
            seen.add(spec.layer)
            if not spec.tau > 0:
                raise ValueError(f"QKClip(layer={spec.layer!r}): tau={spec.tau!r} must be > 0")
            query = self._block(spec, "query", spec.num_heads, named, rank)
            key = self._block(spec, "key", spec.kv_heads, named, rank)
            if spec.num_heads % spec.kv_heads:
                raise ValueError(
                    f"QKClip(layer={spec.layer!r}): num_heads={spec.num_heads} is not a "
                    f"multiple of num_kv_heads={spec.kv_heads}"
                )
            q_dim = (query.stop - query.start) // query.heads
            k_dim = (key.stop - key.start) // key.heads
            if q_dim != k_dim:
                raise ValueError(
                    f"QKClip(layer={spec.layer!r}): query head_dim {q_dim} != key head_dim "
                    f"{k_dim}; check num_heads, num_kv_heads and the row ranges"
                )
            self.blocks.append((query, key))

    def _block(
        self,
        spec: QKClip,
        role: str,
        heads: int,
        named: Mapping[str, torch.Tensor],
        rank: int,
    ) -> _Block:
        where = f"QKClip(layer={spec.layer!r})"
        name = spec.query if role == "query" else spec.key
        if name not in named:
            raise ValueError(
                f"{where}: {role}={name!r} is not a parameter name of this optimizer; give "
                "groups 'param_names' (muon_dist.param_groups does) and use those names"
            )
        tensor = named[name]
        if tensor.ndim != 2:
            raise ValueError(
                f"{where}: {role} {name} has shape {tuple(tensor.shape)}; QK-clip scales "
                "the rows of 2-D projection weights [heads * head_dim, in]"
            )
        rows = spec.query_rows if role == "query" else spec.key_rows
        start, stop = rows if rows is not None else (0, tensor.shape[0])
        if not 0 <= start < stop <= tensor.shape[0]:
            raise ValueError(
                f"{where}: {role}_rows=({start}, {stop}) is not a row range of {name} "
                f"with {tensor.shape[0]} rows"
            )
        if not is_positive_int(heads) or (stop - start) % heads:
            raise ValueError(
                f"{where}: {stop - start} {role} rows of {name} are not divisible into "
                f"{heads!r} heads (num_{'heads' if role == 'query' else 'kv_heads'})"
            )
        index = next((i for i, t in enumerate(self.tensors) if t is tensor), None)
        if index is None:
            index = len(self.tensors)
            self.tensors.append(tensor)
            layout = placement_of(tensor, name, matrix_view(tensor.shape), self.holders.ranks)
            self.rows.append(local_rows(layout, rank))
        return _Block(index, start, stop, heads)

    @torch.no_grad()
    def __call__(self, found_inf: torch.Tensor) -> None:
        """Scale query/key rows of every layer whose recorded max logit exceeds its tau.

        The recorded maxima are maxed over the parameters' ranks in one all-reduce; a layer
        with nothing recorded on any rank is left alone, and so is every layer when
        ``found_inf`` (the step's device flag) says the step left the weights alone.
        """
        maxima = self.tracker.pop()
        unknown = sorted(set(maxima) - {spec.layer for spec in self.layers})
        if unknown:
            raise ValueError(
                f"MaxLogitTracker recorded layers {unknown} that no QKClip names; "
                f"configured layers: {[spec.layer for spec in self.layers]}"
            )
        device = local(self.tensors[0]).device
        logits, taus = [], []
        for spec in self.layers:
            recorded = maxima.get(spec.layer)
            if recorded is None:
                recorded = torch.full((spec.num_heads,), float("-inf"))
            elif recorded.numel() != spec.num_heads:
                raise ValueError(
                    f"layer {spec.layer!r}: recorded logits for {recorded.numel()} heads, "
                    f"QKClip says num_heads={spec.num_heads}"
                )
            logits.append(recorded.to(device, torch.float32))
            taus.append(torch.full((spec.num_heads,), float(spec.tau), device=device))
        peak = torch.cat(logits)
        if self.holders.size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.holders.group)
        tau = torch.cat(taus)
        gamma = torch.where((peak > tau) & (found_inf == 0), tau / peak, torch.ones_like(peak))
        factors = [torch.ones(hi - lo, device=device) for lo, hi in self.rows]
        offset = 0
        for spec, (query, key) in zip(self.layers, self.blocks, strict=True):
            layer_gamma = gamma[offset : offset + spec.num_heads]
            offset += spec.num_heads
            if spec.kv_heads < spec.num_heads:
                self._scale(factors, query, layer_gamma)
                continue
            self._scale(factors, query, layer_gamma.sqrt())
            self._scale(factors, key, layer_gamma.sqrt())
        for tensor, factor in zip(self.tensors, factors, strict=True):
            if factor.numel():
                shard = local(tensor)
                shard.mul_(factor.view(-1, *[1] * (shard.ndim - 1)))

    def _scale(self, factors: list[torch.Tensor], block: _Block, per_head: torch.Tensor) -> None:
        """Multiply the local rows of ``block`` by their head's factor."""
        lo, hi = self.rows[block.tensor]
        first, last = max(lo, block.start), min(hi, block.stop)
        if first >= last:
            return
        per_row = per_head.repeat_interleave((block.stop - block.start) // block.heads)
        factors[block.tensor][first - lo : last - lo] *= per_row[
            first - block.start : last - block.start
        ]


def qk_clipper(
    layers: Sequence[QKClip],
    tracker: MaxLogitTracker | None,
    named: Mapping[str, torch.Tensor],
    rank: int,
    holders: Peers,
) -> QKClipper | None:
    """The clipper of ``layers`` (None without any), refusing a tracker nothing reads."""
    if tracker is not None and not layers:
        raise ValueError("max_logits is only read by qk_clip; pass qk_clip=[QKClip(...)]")
    return QKClipper(layers, tracker, named, rank, holders) if layers else None
