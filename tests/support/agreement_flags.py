"""Flags of a step laid out as the agreement lays them out, for the tests that hold the
fused forms of its decisions (:mod:`muon_dist.step.agree.decisions`) to their torch forms,
on the CPU and on a GPU."""

import torch
from bits import assert_same_bits

from muon_dist.step.agree.decisions import count_bad_, settle_
from muon_dist.step.agree.report import NONFINITE, TOO_LARGE
from muon_dist.step.shard.scalars import Segments

# What one step's flags hold, by case: (segment, index, value) written over the base flags.
CASES: dict[str, tuple[str, int, float] | None] = {
    "nothing found": None,
    "a non-finite gradient": ("verdict", 3, NONFINITE),
    "a norm too large": ("verdict", 20, TOO_LARGE),
    "a refused rank": ("failed", 0, 4.0),
    "a value differs": ("values", 5, 100.0),
    "a replica's norm differs": ("negated_norms", 0, -2.0),
    "a digest differs": ("digests", 2, 54321.0),
    "a bad result": ("bad_results", 9, 1.0),
    "found before": ("found_inf", 0, 1.0),
}
# Cases whose flags set found_inf when the agreement settles them (not the results').
FOUND_AT_AGREEMENT = {
    "a non-finite gradient",
    "a norm too large",
    "a refused rank",
    "a value differs",
    "a replica's norm differs",
    "a digest differs",
}


def assert_bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: object) -> None:
    for x, y in zip(a, b, strict=True):
        assert_same_bits(x, y, what)


class Flags:
    """One step's flags in one buffer over ``params`` parameters (about 70% with a
    gradient, half of them Muon tensors), ``compared`` values compared across ``ranks``
    (all equal), three replicas' norms (one of them absent everywhere) and ``results``
    Muon tensors' result flags, with ``case`` written over them."""

    def __init__(
        self,
        params: int,
        case: str,
        compared: int = 11,
        ranks: int = 3,
        results: int = 13,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.compared_layout = Segments.of(
            values=compared, negated=compared, digests=ranks, norms=3, negated_norms=3
        )
        self.layout = Segments.of(
            present=params,
            verdict=params,
            failed=1,
            compared=self.compared_layout.numel,
            bad_results=results,
            found_inf=1,
        )
        buffer = torch.zeros(self.layout.numel)
        flag = self.layout.views(buffer)
        flag["present"].copy_((torch.rand(params, generator=g) < 0.7).float())
        compare = self.compared_layout.views(flag["compared"])
        values = torch.randn(compared, generator=g)
        compare["values"].copy_(values)
        compare["negated"].copy_(-values)
        compare["digests"].fill_(12345.0)
        compare["norms"].copy_(torch.tensor([2.5, -torch.inf, 0.0]))
        compare["negated_norms"].copy_(torch.tensor([-2.5, -torch.inf, -0.0]))
        written = CASES[case]
        if written is not None:
            segment, index, value = written
            views = compare if segment in compare else flag
            views[segment][index % views[segment].numel()] = value
        self.buffer = buffer.to(device)
        self.muon_index = torch.randperm(params, generator=g)[: params // 2 + 1].to(device)

    def settle(self, fused: bool, compare: bool, results: bool) -> list[torch.Tensor]:
        """Settle a copy of the flags as the agreement does after its all-reduce (with or
        without the comparison), or after the results' (``results``: found_inf among the
        flags read); the copy's buffer, keep mask and differs flag."""
        buffer = self.buffer.clone()
        flag = self.layout.views(buffer)
        keep = torch.zeros(len(self.muon_index), dtype=torch.bool, device=buffer.device)
        differs = torch.zeros((), dtype=torch.bool, device=buffer.device)
        checked = ("bad_results", "found_inf") if results else ("verdict", "failed")
        settle_(
            buffer[self.layout.bounds(*checked)],
            flag["present"],
            self.muon_index,
            flag["found_inf"].view(()),
            keep,
            self.compared_layout.views(flag["compared"]) if compare else None,
            differs if compare else None,
            fused=fused,
        )
        return [buffer, keep, differs]

    def found_at_agreement(self) -> bool:
        """Whether settling after the all-reduce, comparison included, found something."""
        buffer = self.settle(False, True, False)[0]
        return bool(buffer[self.layout.bounds("found_inf")].item())


def settle_both_forms(case: str, params: int, device: torch.device | str = "cpu") -> None:
    """Both forms settle ``case``'s flags alike, in every way the agreement settles them."""
    flags = Flags(params, case, seed=params, device=device)
    for compare, results in ((True, False), (False, False), (False, True)):
        torch_form = flags.settle(False, compare, results)
        fused = flags.settle(True, compare, results)
        assert_bitwise_equal(torch_form, fused, (case, compare, results))
    assert flags.found_at_agreement() == (case in FOUND_AT_AGREEMENT)


def count_both_forms(with_dropped: bool, device: torch.device | str = "cpu") -> None:
    """Non-finite sums (inf, −inf, NaN) counted per tensor, several matrices to a tensor,
    onto counts already there, the dropped ones left out where given: both forms alike,
    and the count right."""
    g = torch.Generator().manual_seed(3)
    matrices = 29
    sums = torch.randn(matrices, generator=g)
    sums[[1, 4, 5, 17, 28]] = torch.tensor([torch.inf, -torch.inf, torch.nan, torch.inf, 1e38])
    sums[[20, 21]] = torch.nan
    tensors = torch.randint(0, 6, (matrices,), generator=g)
    dropped = (torch.rand(matrices, generator=g) < 0.3) if with_dropped else None
    before = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.0])
    got = []
    for fused in (False, True):
        results = before.to(device, copy=True)
        count_bad_(
            sums.to(device),
            tensors.to(device),
            results,
            None if dropped is None else dropped.to(device),
            fused=fused,
        )
        got.append(results.cpu())
    assert_bitwise_equal(got[:1], got[1:], with_dropped)
    bad = ~torch.isfinite(sums) if dropped is None else ~torch.isfinite(sums) & ~dropped
    assert got[0].sum().item() == before.sum().item() + bad.sum().item()
