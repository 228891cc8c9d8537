"""The CPU parity suite's layouts on GPUs with NCCL, one spawned process per GPU (`pytest -m gpu`).

World sizes up to the number of GPUs present (1 to 4). With fp32 communication the
Newton–Schulz runs in fp32 with TF32 off: cuBLAS may round batched and single bf16 GEMMs
differently, which would hide real errors behind bf16 noise. The criteria: fp32, max
relative difference of the parameters <= 1e-5; bf16, within bf16 rounding, <= 2e-2 of the
update norm-wise (cuBLAS rounds batched and single bf16 GEMMs differently, which moves
single elements by several bf16 ulps). With ``--write-tables`` the results become the
parity table of benchmarks/README.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator

import pytest
import torch
from dist_harness import pool
from parity_cases import case_names, parity_worker
from repo_paths import benchmark_tables

pytestmark = pytest.mark.gpu

# comm dtype -> (Newton–Schulz dtype, error measure, tolerance, how the table states it)
CRITERIA = {
    "float32": ("float32", "param", 1e-5, "parameter rel ≤ 1e-5"),
    "bfloat16": ("bfloat16", "update_fro", 2e-2, "update rel (norm-wise) ≤ 2e-2"),
}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
CASES = [
    pytest.param(world_size, name, comm, id=f"w{world_size}-{name}-{comm}")
    for world_size in (1, 2, 3, 4)
    for name in case_names(world_size)
    for comm in CRITERIA
]
# (world size, comm dtype) -> layout -> (worst error over ranks, passed)
RESULTS: dict[tuple[int, str], dict[str, tuple[float, bool]]] = {}


def gpu_parity_worker(rank: int, world_size: int, name: str, comm: str) -> dict[str, float]:
    torch.backends.cuda.matmul.allow_tf32 = False
    ns = CRITERIA[comm][0]
    return parity_worker(rank, world_size, name, comm, ns, device="cuda")


@pytest.fixture(scope="module", autouse=True)
def _parity_table(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not (request.config.getoption("--write-tables") and RESULTS):
        return
    tables = benchmark_tables()
    rows = []
    for (world_size, comm), layouts in sorted(RESULTS.items()):
        worst = max(layouts, key=lambda name: layouts[name][0])
        rows.append(
            {
                "GPUs": str(world_size),
                "comm / Newton–Schulz dtype": f"{SHORT[comm]} / {SHORT[CRITERIA[comm][0]]}",
                "criterion": CRITERIA[comm][3],
                "layouts passed": f"{sum(ok for _, ok in layouts.values())}/{len(layouts)}",
                "worst (layout)": f"{layouts[worst][0]:.2e} ({worst})",
            }
        )
    args = [a for a in request.config.invocation_params.args if a != "--write-tables"]
    command = "PYTHONPATH=$PWD python3 -m pytest " + shlex.join(args)
    tables.record("parity", rows, tables.run_info(gpus=torch.cuda.device_count(), command=command))


@pytest.mark.parametrize(("world_size", "name", "comm"), CASES)
def test_sharded_step_matches_single_device_on_nccl(world_size: int, name: str, comm: str) -> None:
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, this machine has {torch.cuda.device_count()}")
    _, metric, tolerance, _ = CRITERIA[comm]
    results = pool(world_size, "nccl").run(gpu_parity_worker, name, comm)
    worst = max(err[metric] for err in results)
    ok = worst <= tolerance and all(err["bf16_param"] <= 3e-2 for err in results)
    RESULTS.setdefault((world_size, comm), {})[name] = (worst, ok)
    for rank, err in enumerate(results):
        assert err[metric] <= tolerance, f"rank {rank}: {metric} {err[metric]:.2e} > {tolerance:g}"
        assert err["bf16_param"] <= 3e-2, f"rank {rank}: {err}"
