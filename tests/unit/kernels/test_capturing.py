"""``kernels.graphs.capturing`` pauses Python's cyclic collector for exactly the capture."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from muon_dist.kernels import graphs


@pytest.fixture
def fake_graph(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``torch.cuda.graph`` replaced by a context that records how it was entered."""
    entered: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def graph(cuda_graph: object, **kwargs: Any) -> Iterator[None]:
        entered.append({"collecting": gc.isenabled(), **kwargs})
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    return entered


def test_the_collector_is_paused_inside_and_restored_after(
    fake_graph: list[dict[str, Any]],
) -> None:
    assert gc.isenabled()
    stream = object()
    with graphs.capturing(object(), stream):  # type: ignore[arg-type]
        assert not gc.isenabled()
    assert gc.isenabled()
    assert fake_graph == [
        {"collecting": False, "stream": stream, "capture_error_mode": "thread_local"}
    ]


def test_the_collector_is_restored_when_the_capture_raises(
    fake_graph: list[dict[str, Any]],
) -> None:
    with pytest.raises(RuntimeError, match="kernel failed"):
        with graphs.capturing(object()):  # type: ignore[arg-type]
            raise RuntimeError("kernel failed")
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused(fake_graph: list[dict[str, Any]]) -> None:
    gc.disable()
    try:
        with graphs.capturing(object()):  # type: ignore[arg-type]
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
