"""Trust across ranks (2 gloo ranks; saving also on 1): see trust_cases.py."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from trust_cases import CASES, save_worker, trust_worker


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_agree_or_all_raise(name: str) -> None:
    assert run_distributed(2, trust_worker, name, timeout=120) == [name] * 2


def test_fsdp_state_dict_saves_on_one_rank() -> None:
    assert run_distributed(1, save_worker, timeout=120) == ["saved"]
