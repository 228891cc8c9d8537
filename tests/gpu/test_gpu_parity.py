"""The CPU parity suite's layouts on GPUs with NCCL, one spawned process per GPU (`pytest -m gpu`).

World sizes up to the number of GPUs present (1 to 4). fp32 runs with TF32 off. The criteria
are the CPU suite's (parity_cases.parity_violations): fp32 communication and Newton–Schulz
exact, bf16 within bf16 rounding, both norm-wise relative to each parameter's update (cuBLAS
rounds batched and single bf16 GEMMs differently, which moves single elements by several
bf16 ulps). With ``--write-tables`` the results become the parity table of
benchmarks/README.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest
import torch
from dist_harness import pool
from parity_cases import (
    PRECISIONS,
    case_names,
    parity_violations,
    parity_worker,
    update_tolerance,
)
from repo_paths import benchmark_tables

SHORT = {"float32": "fp32", "bfloat16": "bf16"}
CASES = [
    pytest.param(world_size, name, precision, id=f"w{world_size}-{name}-{precision}")
    for world_size in (1, 2, 3, 4)
    for name in case_names(world_size)
    for precision in PRECISIONS
]
# (world size, precision) -> layout -> (worst error over ranks, passed)
RESULTS: dict[tuple[int, str], dict[str, tuple[float, bool]]] = {}


def gpu_parity_worker(rank: int, world_size: int, name: str, precision: str) -> dict[str, float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    comm, ns = PRECISIONS[precision]
    return parity_worker(rank, world_size, name, comm, ns, device="cuda")


@pytest.fixture(scope="module", autouse=True)
def _parity_table(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not (request.config.getoption("--write-tables") and RESULTS):
        return
    tables = benchmark_tables()
    rows = []
    for (world_size, precision), layouts in sorted(RESULTS.items()):
        worst = max(layouts, key=lambda name: layouts[name][0])
        rows.append(
            {
                "GPUs": str(world_size),
                "comm / Newton–Schulz dtype": " / ".join(SHORT[d] for d in PRECISIONS[precision]),
                "criterion": f"update rel (norm-wise) ≤ {update_tolerance(precision):g}",
                "layouts passed": f"{sum(ok for _, ok in layouts.values())}/{len(layouts)}",
                "worst (layout)": f"{layouts[worst][0]:.2e} ({worst})",
            }
        )
    args = [a for a in request.config.invocation_params.args if a != "--write-tables"]
    command = "PYTHONPATH=$PWD python3 -m pytest " + shlex.join(args)
    tables.record("parity", rows, tables.run_info(gpus=torch.cuda.device_count(), command=command))


@pytest.mark.parametrize(("world_size", "name", "precision"), CASES)
def test_sharded_step_matches_single_device_on_nccl(
    world_size: int, name: str, precision: str
) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    results = pool(world_size, "nccl").run(gpu_parity_worker, name, precision)
    worst = max(err["update_fro"] for err in results)
    ok = not any(parity_violations(err, precision) for err in results)
    RESULTS.setdefault((world_size, precision), {})[name] = (worst, ok)
    for rank, err in enumerate(results):
        assert not parity_violations(err, precision), f"rank {rank}: {err}"


def gpu_dion2_worker(rank: int, world_size: int, name: str) -> dict[str, float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    return parity_worker(rank, world_size, name, "float32", "float32", "cuda", "dion2")


@pytest.mark.parametrize(
    ("world_size", "name"),
    [pytest.param(w, name, id=f"w{w}-{name}") for w in (1, 2, 3, 4) for name in case_names(w)],
)
def test_dion2_step_matches_single_device_on_nccl(world_size: int, name: str) -> None:
    """Dion2 on NCCL, fp32: the partial norms' all-reduce, the host copy of the choice and
    the exchanges sized by it, against the single-device reference."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    results = pool(world_size, "nccl").run(gpu_dion2_worker, name)
    for rank, err in enumerate(results):
        assert not parity_violations(err, "fp32"), f"rank {rank}: {err}"
