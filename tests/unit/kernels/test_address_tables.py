"""Where address tables may be made: a table made while a graph is captured is read again at
every replay, so only a captured step's own staging round may make one then."""

from __future__ import annotations

import pytest
import torch

from muon_dist.kernels.tables import StepStaging, address_table, tables_allowed

CUDA = torch.device("cuda")


def test_a_capture_allows_tables_only_in_a_captured_steps_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert tables_allowed(CUDA)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not tables_allowed(CUDA)
    with StepStaging().round():
        assert tables_allowed(CUDA)
    assert not tables_allowed(CUDA)
    assert tables_allowed(torch.device("cpu"))


def test_a_table_made_in_another_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared ring's buffers are rewritten long before such a graph's last replay."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="tables_allowed"):
        address_table([[1, 2]], CUDA)
