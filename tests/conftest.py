"""Session-wide test setup: every test folder on ``sys.path``, the ``slow`` and ``gpu`` markers
set by path, Triton's interpreter and one intra-op thread on CPU, GPU tests skipped without
CUDA, the longest files first (for the xdist workers of scripts/run_tests.sh), distributed
worker pools closed at the end.

Where a test lives (tests/tooling/test_test_layout.py checks it; the README's "Tests" says
the same):

- ``tests/unit/<layer>/``: in-process tests of one layer of ``muon_dist`` (kernels, runtime,
  rules, plan, options, routing, comm, state, step, optimizer, integrations; optimizer is
  the top: optimizer.py, qk_clip.py). A test there imports modules of its layer and the
  layers below, never of a higher one (it may drive them through the package's API,
  ``import muon_dist``): its folder is the highest layer whose modules it imports. It
  spawns no ranks.
- ``tests/distributed/<topic>/``: tests that spawn ranks (``dist_harness``), by topic
  (parity, rules, features, overlap, host, reliability, fuzz, models), with the in-process
  checks of the same topic.
- ``tests/gpu/``: tests that need CUDA; every test there is marked ``gpu``.
- ``tests/tooling/``: tests of benchmarks/, examples/, scripts/, tools/, CI and the repo's
  structure.
- ``tests/support/``: helpers that tests in several folders import; no tests.
- A worker or helper module that one folder's tests use (``*_cases.py``) sits beside them.
  Module names are unique across tests/: every folder is on ``sys.path`` and modules import
  one another by bare name.
- The tier is the file name: a ``test_*_slow.py`` file is the slow tier (multi-process
  sweeps, end-to-end runs; every test in it is marked ``slow``), every other file is the
  quick tier, ``pytest tests --ignore-glob='*_slow.py'``. No test file sets ``slow`` or
  ``gpu`` itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from repo_paths import TESTS, add_module_folders_to_path

add_module_folders_to_path()
from dist_harness import close_pools  # noqa: E402

# Without CUDA the Triton kernels run in Triton's CPU interpreter (fp32 tests in
# test_triton_*.py). It must be chosen before Triton is first imported; with CUDA the real
# kernels are built and the gpu tests check them, so it is left off there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread, as in the ranks (dist_harness) and launches: the tensors here are
    # tiny, and a second OpenMP thread on a 2-core machine that also runs ranks or another
    # process spins against them (CHANGELOG, Unreleased, has the measurement).
    torch.set_num_threads(1)

GPU = TESTS / "gpu"
TOOLING = TESTS / "tooling"
SLOW_SUFFIX = "_slow.py"


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's --dist loadfile hands out files by their number of tests, most first,
    # unless told otherwise: that put the few-test slow tooling files last, the example's
    # launches on one worker while the other sat idle. Hand them out in our order instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-tables",
        action="store_true",
        help="record the GPU parity results in benchmarks/README.md (benchmarks/tables.py)",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA: run `pytest -m gpu` on a GPU machine")
    for item in items:
        if item.path.name.endswith(SLOW_SUFFIX):
            item.add_marker(pytest.mark.slow)
        if item.path.is_relative_to(GPU):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
    # The longest files first, each file's tests in their order: scripts/run_tests.sh hands
    # whole files to two xdist workers in this order, so the example's launches (the slow
    # tooling files) start at once instead of leaving one worker alone at the end, then the
    # rest of the slow tier, then the quick one.
    items.sort(key=_longest_first)


def _longest_first(item: pytest.Item) -> int:
    slow = item.path.name.endswith(SLOW_SUFFIX)
    return 0 if slow and item.path.is_relative_to(TOOLING) else 1 if slow else 2


@pytest.fixture(scope="session", autouse=True)
def _distributed_pools() -> Iterator[None]:
    yield
    close_pools()
