"""The agreement's decisions from its flags (:mod:`muon_dist.step.agree.decisions`): the
one-launch Triton forms, run in the interpreter on CPU, write the bits the torch forms
write, on flags laid out as the agreement lays them out (``found_inf`` inside the flags),
with blocks shrunk so that every loop runs several times with a partial last block."""

from collections.abc import Iterator

import pytest
import torch
from agreement_flags import CASES, Flags, count_both_forms, settle_both_forms

from muon_dist.kernels.availability import interpret_mode
from muon_dist.step.agree.decisions import settle_

if not interpret_mode():
    pytest.skip("these CPU tests need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")
triton_agreement = pytest.importorskip("muon_dist.kernels.triton_agreement")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(triton_agreement, "_BLOCK", 8)
    monkeypatch.setattr(triton_agreement, "_COUNT_BLOCK", 8)
    yield


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("params", [1, 23])
def test_settle_fused_writes_the_torch_forms_bits(case: str, params: int) -> None:
    """After the agreement's all-reduce (with and without the comparison) and after the
    results' (``found_inf`` among the flags read): the same buffer, keep mask and differs
    flag, bit for bit, and found_inf set exactly where the case should set it."""
    settle_both_forms(case, params)


@pytest.mark.parametrize("with_dropped", [False, True])
def test_count_bad_fused_writes_the_torch_forms_bits(with_dropped: bool) -> None:
    count_both_forms(with_dropped)


def test_settle_refuses_compared_without_differs() -> None:
    flags = Flags(4, "nothing found")
    flag = flags.layout.views(flags.buffer)
    with pytest.raises(ValueError, match="compared and differs together"):
        settle_(
            flags.buffer[:4],
            flag["present"],
            flags.muon_index,
            flag["found_inf"].view(()),
            torch.zeros(3, dtype=torch.bool),
            flags.compared_layout.views(flag["compared"]),
            fused=False,
        )
