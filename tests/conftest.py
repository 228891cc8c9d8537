"""Session-wide test setup: Triton's interpreter on CPU, GPU tests skipped without CUDA,
distributed worker pools closed at the end."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from dist_harness import close_pools

# Without CUDA the Triton kernels run in Triton's CPU interpreter (fp32 tests in
# test_triton_*.py). It must be chosen before Triton is first imported; with CUDA the real
# kernels are built and the gpu tests check them, so it is left off there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-tables",
        action="store_true",
        help="record the GPU parity results in benchmarks/README.md (benchmarks/tables.py)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _distributed_pools() -> Iterator[None]:
    yield
    close_pools()
