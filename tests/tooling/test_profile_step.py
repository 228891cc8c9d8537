"""benchmarks/profile_step.py: its trace arithmetic on hand-made Chrome traces, the plan's
FLOP count, and one run end to end on CPU/gloo."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step
from trace_summary import total, union  # on sys.path through profile_step

from muon_dist.plan.build import ns_cost

OPTIMIZER = "Optimizer.step#Muon.step"


MAIN = 1  # the host thread that steps; backward runs on another


def _range(name: str, start: float, end: float) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": name,
        "ts": start,
        "dur": end - start,
        "tid": MAIN,
    }


def _launched(
    name: str, launch: float, start: float, end: float, correlation: int, tid: int = MAIN
) -> list[dict[str, Any]]:
    """A kernel and the host call that launched it (5 µs at ``launch`` on thread ``tid``)."""
    return [
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": launch,
            "dur": 5.0,
            "tid": tid,
            "args": {"correlation": correlation},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": name,
            "ts": start,
            "dur": end - start,
            "args": {"correlation": correlation, "stream": 7},
        },
    ]


# A training step's window, 0-1000 µs, with the optimizer's step launched at 100-600 µs:
# (name, launch time, start, end) of each kernel.
KERNELS = [
    ("nvjet_tst_gemm_forward", 10, 20, 120),  # forward's product: not Newton–Schulz
    ("_sym_product_kernel", 150, 200, 400),  # Newton–Schulz
    ("ncclDevKernel_SendRecv", 160, 300, 500),  # all-to-all: 300-400 and 450-500 covered
    ("vectorized_elementwise_kernel", 170, 450, 550),  # the update
    ("sm90_xmma_gemm_bf16bf16", 180, 600, 700),  # Newton–Schulz
    ("cutlass_gemm_tail", 190, 950, 1100),  # Newton–Schulz, past the window's end
]


def _trace(extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    events = [_range(profile_step.STEP_RANGE, 0, 1000), _range(OPTIMIZER, 100, 600)]
    for correlation, (name, launch, start, end) in enumerate(KERNELS):
        events += _launched(name, launch, start, end, correlation)
    return {"traceEvents": events + (extra or [])}


def _clipped(names: tuple[str, ...]) -> list[tuple[float, float]]:
    return [(max(a, 0), min(b, 1000)) for n, _, a, b in KERNELS if n in names]


def test_a_step_splits_into_parts_that_add_up_to_its_wall() -> None:
    (step,) = profile_step.StepTrace(_trace()).steps(profile_step.STEP_RANGE)
    assert step["wall"] == pytest.approx(1.0)
    assert sum(step[k] for k in profile_step.PARTS) == pytest.approx(step["wall"])
    # Newton–Schulz: the optimizer's matrix products, not forward's, not the update.
    ns = _clipped(("_sym_product_kernel", "sm90_xmma_gemm_bf16bf16", "cutlass_gemm_tail"))
    assert step["ns_source"] == "matrix products in the optimizer"
    assert step["ns_sum"] == pytest.approx(sum(b - a for a, b in ns) / 1e3)
    assert step["ns_busy"] == pytest.approx(total(union(ns)) / 1e3)
    # Exposed comm: the all-to-all's time when no compute kernel ran (400-450 µs).
    compute = _clipped(tuple(n for n, *_ in KERNELS if "nccl" not in n))
    comm = _clipped(("ncclDevKernel_SendRecv",))
    covered = total(union(compute + comm)) - total(union(compute))
    assert step["exposed_comm"] == pytest.approx(covered / 1e3) == pytest.approx(0.05)
    assert step["comm"] == pytest.approx(0.2)
    # Idle: the wall less the union of every kernel.
    assert step["idle"] == pytest.approx((1000 - total(union(compute + comm))) / 1e3)
    # Host: until the last launch call ended; launch: the calls' summed time.
    assert step["host"] == pytest.approx((190 + 5) / 1e3)
    assert step["launch"] == pytest.approx(len(KERNELS) * 5 / 1e3)
    assert step["launches"] == step["kernels"] == len(KERNELS)


def test_a_labelled_newton_schulz_range_decides_what_counts() -> None:
    # The label covers the launches at 150-170 µs: the elementwise kernel launched inside it
    # counts, the all-to-all launched inside it and the products launched after it do not.
    trace = profile_step.StepTrace(_trace([_range(profile_step.NS_RANGE, 145, 175)]))
    (step,) = trace.steps(profile_step.STEP_RANGE)
    ns = _clipped(("_sym_product_kernel", "vectorized_elementwise_kernel"))
    assert step["ns_source"] == "annotation"
    assert step["ns_sum"] == pytest.approx(sum(b - a for a, b in ns) / 1e3)
    assert sum(step[k] for k in profile_step.PARTS) == pytest.approx(step["wall"])


def test_a_graphs_kernels_are_classed_one_by_one() -> None:
    # One graph launch (correlation 99) in the optimizer replays a product and an
    # elementwise kernel: only the product counts; a symmetric product whose launch call
    # the trace lacks still counts.
    graph = _launched("nvjet_tst_gemm_ns", 120, 720, 800, 99)
    graph.append({**graph[1], "name": "elementwise_kernel", "ts": 800, "dur": 50})
    orphan = _launched("_sym_product_kernel", 130, 860, 900, 98)[1:]
    # Events without a correlation id: a memset (other compute) and a host call.
    orphan.append({"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 905, "dur": 5})
    orphan.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 990})
    (step,) = profile_step.StepTrace(_trace(graph + orphan)).steps(profile_step.STEP_RANGE)
    (plain,) = profile_step.StepTrace(_trace()).steps(profile_step.STEP_RANGE)
    assert step["ns_sum"] == pytest.approx(plain["ns_sum"] + (80 + 40) / 1e3)
    assert step["other_compute"] == pytest.approx(plain["other_compute"] + (50 + 5) / 1e3)
    assert step["launches"] == plain["launches"] + 1


def test_a_product_another_thread_launches_during_the_step_is_not_newton_schulz() -> None:
    # Backward's thread launches a product while the main thread is inside Optimizer.step
    # (as when the step's hooks run beside it): only the main thread's launches count.
    other = _launched("nvjet_tst_gemm_backward", 300, 720, 800, 97, tid=MAIN + 1)
    (step,) = profile_step.StepTrace(_trace(other)).steps(profile_step.STEP_RANGE)
    (plain,) = profile_step.StepTrace(_trace()).steps(profile_step.STEP_RANGE)
    assert step["ns_sum"] == pytest.approx(plain["ns_sum"])
    assert step["other_compute"] == pytest.approx(plain["other_compute"] + 80 / 1e3)


def test_steps_are_cut_by_their_windows() -> None:
    # Two windows, 0-500 and 500-1000 µs: each kernel's time lands in the window it ran in.
    events = _trace()["traceEvents"][1:]
    events += [_range(profile_step.STEP_RANGE, 0, 500), _range(profile_step.STEP_RANGE, 500, 1000)]
    steps = profile_step.StepTrace({"traceEvents": events}).steps(profile_step.STEP_RANGE)
    (whole,) = profile_step.StepTrace(_trace()).steps(profile_step.STEP_RANGE)
    assert len(steps) == 2
    for key in (*profile_step.PARTS, "ns_sum", "comm"):
        assert steps[0][key] + steps[1][key] == pytest.approx(whole[key])


def test_a_cpu_trace_reports_the_wall_and_says_it_has_no_kernels() -> None:
    cpu_op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 50}
    trace = {"traceEvents": [_range(profile_step.STEP_RANGE, 0, 400), cpu_op]}
    (step,) = profile_step.StepTrace(trace).steps(profile_step.STEP_RANGE)
    assert step["wall"] == pytest.approx(0.4)
    assert all(step[k] is None for k in profile_step.DEVICE_KEYS)
    report = {
        "name": "cpu",
        "world_size": 1,
        "plan": profile_step.plan_flops([], 1, False, bucket_bytes=1 << 20, itemsize=2),
        "phases": {"step": profile_step.combine([[step]])},
    }
    assert "no device kernels" in profile_step.notes(report)[0]
    assert profile_step.table_rows(report)[0]["NS sum ms"] == "-"


def _step(wall: float, ns: float) -> dict[str, Any]:
    return {"wall": wall, "ns_sum": ns, "idle": wall - ns, "ns_source": "annotation"}


def test_combine_takes_the_slowest_rank_and_the_largest_ns_sum_per_step() -> None:
    ranks = [
        [_step(10.0, 8.0), _step(12.0, 7.0), _step(11.0, 7.5)],
        [_step(11.0, 6.0), _step(10.0, 9.0), _step(13.0, 6.5)],
    ]
    result = profile_step.combine(ranks)
    # Slowest per step: rank 1, rank 0, rank 1; their idle is wall - ns of that rank.
    assert result["slowest"]["wall"] == 12.0  # median of 11, 12, 13
    assert result["slowest"]["idle"] == 5.0  # median of 5, 5, 6.5
    assert result["slowest"]["ns_sum_max"] == 8.0  # median of 8, 9, 7.5
    assert result["slowest_ranks"] == [1, 0, 1]
    assert [r["wall"] for r in result["per_rank"]] == [11.0, 11.0]
    assert result["slowest"]["ns_source"] == "annotation"


def test_gram_restarting_every_step_does_the_standard_iterations_work() -> None:
    # Each segment of one step forms a Gram matrix and a product with X: the standard step.
    for rows, cols, steps in ((64, 256, 5), (300, 100, 3), (128, 128, 1)):
        every = tuple(range(1, steps))
        assert profile_step.dispatched_flops(rows, cols, steps, True, every) == ns_cost(
            rows, cols, steps
        )
        assert profile_step.dispatched_flops(rows, cols, steps, False) == ns_cost(rows, cols, steps)
    # Fewer restarts pay from an aspect ratio on: the m×m products replace m²n ones.
    assert profile_step.dispatched_flops(4096, 14336, 5, True) < ns_cost(4096, 14336, 5)


def _group(
    shapes: list[tuple[int, int]], method: str = "standard", rule: str = "muon"
) -> dict[str, Any]:
    return {
        "algorithm": "muon",
        "params": [torch.empty(shape) for shape in shapes],
        "ns_method": method,
        "ns_steps": 5,
        "rule": rule,
    }


def test_plan_flops_splits_the_work_by_owner() -> None:
    # Replicated tensors: every rank holds every matrix, the plan splits their owners.
    even = profile_step.plan_flops(
        [_group([(64, 64)] * 4)], 2, False, bucket_bytes=1 << 20, itemsize=2
    )
    assert even["owner_imbalance"] == pytest.approx(1.0)
    assert sum(even["ranks"]) == pytest.approx(4 * ns_cost(64, 64))
    assert even["ranks"] == even["standard_ranks"]
    odd = profile_step.plan_flops(
        [_group([(64, 64)] * 3)], 2, False, bucket_bytes=1 << 20, itemsize=2
    )
    assert odd["owner_imbalance"] == pytest.approx(2 / 1.5)
    # On CUDA "auto" takes Gram for a 64×256 matrix, and the count follows it.
    gram = profile_step.plan_flops(
        [_group([(64, 256)] * 2, "auto")], 2, True, bucket_bytes=1 << 20, itemsize=2
    )
    assert sum(gram["ranks"]) == pytest.approx(2 * profile_step.dispatched_flops(64, 256, 5, True))
    assert sum(gram["standard_ranks"]) == pytest.approx(2 * ns_cost(64, 256))


def test_plan_flops_counts_nothing_where_a_rule_selects_slices() -> None:
    # Dion2 orthogonalizes the slices each step chooses: the plan alone cannot count them,
    # so the table shows no rate and no imbalance rather than whole matrices' work.
    groups = [_group([(64, 64)] * 2), _group([(64, 64)] * 2, rule="dion2")]
    flops = profile_step.plan_flops(groups, 2, False, bucket_bytes=1 << 20, itemsize=2)
    assert set(flops.values()) == {None}
    assert profile_step.plan_flops(groups[:1], 2, False, bucket_bytes=1 << 20, itemsize=2)["ranks"]
    step = {key: 1.0 for key in profile_step.DEVICE_KEYS} | _step(10.0, 8.0)
    report = {
        "name": "dion2",
        "world_size": 1,
        "plan": flops,
        "phases": {"step": profile_step.combine([[step]])},
    }
    (row,) = profile_step.table_rows(report)
    assert row["NS sum ms"] == "8.0"
    assert row["NS TFLOP/s"] == "-"
    assert row["imbalance owners / buckets"] == "- / -"


def test_rule_names_the_report_and_is_refused_with_train(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--preset", "tiny", "--rule", "dion2"])
    assert profile_step.parse_args().name == "tiny_dion2"
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--train", "--rule", "dion2"])
    with pytest.raises(SystemExit):
        profile_step.parse_args()
    assert "--optimizer dion2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--preset", "tiny", "--steps", "0"], "--steps 0"),
        (["--preset", "tiny", "--warmup", "-1"], "--warmup -1"),
        (["--preset", "tiny", "--layers", "0"], "--layers 0"),
    ],
)
def test_counts_that_profile_nothing_are_refused(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    named: str,
) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_step.py", *flags])
    with pytest.raises(SystemExit) as refused:
        profile_step.parse_args()
    assert refused.value.code == 2
    assert named in capsys.readouterr().err


def test_from_json_names_the_file_and_what_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign JSON (say, a sweep's results.json), a truncated one and a missing one each
    stop ``--from-json`` with the file and the cause, never a KeyError."""
    foreign = tmp_path / "results.json"
    foreign.write_text(json.dumps({"model": "tiny", "runs": []}))
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"name": "tiny", "phases": {')
    for path, problem in (
        (foreign, "lacks name, world_size, plan, phases"),
        (truncated, "not valid JSON"),
        (tmp_path / "missing.json", "cannot be read"),
    ):
        monkeypatch.setattr(sys, "argv", ["profile_step.py", "--from-json", str(path)])
        with pytest.raises(SystemExit) as refused:
            profile_step.main()
        message = str(refused.value.code)
        assert message.startswith(f"--from-json {path}: ") and problem in message, message


def test_the_kernel_profiler_refuses_counts_below_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tools/profile_step.py (a module of the same name: loaded by path)."""
    spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "tools/profile_step.py")
    assert spec is not None and spec.loader is not None
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    for flag in ("--layers", "--rows", "--replicate"):
        monkeypatch.setattr(sys, "argv", ["profile_step.py", flag, "0"])
        with pytest.raises(SystemExit) as refused:
            kernels.main()
        assert refused.value.code == 2 and f"{flag} 0 must be >= 1" in capsys.readouterr().err
