"""BackwardStart against a stand-in Muon phase: a hook that starts no bucket dispatches no
operation, the norms are taken once per hook that starts buckets, of the gradients those
buckets are the first to read, and step() compares only what the started buckets read."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Sequence
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from dispatch_count import CountOps

from muon_dist.runtime import Task
from muon_dist.step.launch import backward
from muon_dist.step.launch.backward import BackwardStart

# Buckets in plan order, by the tensors they need: tensor 2 is in the first two.
BUCKETS = ([0, 1], [2], [2, 3], [4, 5])


class Phase:
    """What BackwardStart uses of a MuonPhase and of its early program; each bucket reads its
    gradients' sums."""

    def __init__(self, buckets: Sequence[Sequence[int]], tensors: int) -> None:
        group: defaultdict[str, float] = defaultdict(float)  # every option 0.0
        entries = [SimpleNamespace(tensor_index=j, group=group) for j in range(tensors)]
        self.tensors = SimpleNamespace(entries=entries, device=torch.device("cpu"))
        self.plan = SimpleNamespace(buckets=[SimpleNamespace(views=list(b)) for b in buckets])
        self.settings = SimpleNamespace(max_inflight=2)
        self.grads = SimpleNamespace(tensors={}, set_one=self._set_one)
        self.pieces = SimpleNamespace(grads=self.grads)
        self.transaction = SimpleNamespace(end=lambda: None, held_bytes=lambda: 0)
        self.reads: list[tuple[int, list[float]]] = []  # (bucket, its gradients' sums)

    def _set_one(self, j: int, grad: torch.Tensor | None) -> None:
        self.grads.tensors[j] = grad

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        for j, grad in enumerate(grads):
            self._set_one(j, grad)

    # It is its own early program too (open, bucket, close).
    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def bucket(self, index: int) -> Task:
        return Task((f"bucket {index}",), self._read(index))

    def _read(self, index: int) -> Generator[None, None, None]:
        views = self.plan.buckets[index].views
        self.reads.append((index, [float(self.grads.tensors[j].sum()) for j in views]))
        yield


def _start(buckets: Sequence[Sequence[int]] = BUCKETS) -> tuple[BackwardStart, Phase]:
    tensors = 1 + max(j for b in buckets for j in b)
    phase = Phase(buckets, tensors)
    names = [f"t{j}" for j in range(tensors)]
    return BackwardStart(phase, names, phase), phase  # type: ignore[arg-type]


def _in_backward(body: Callable[[], None]) -> None:
    """Run ``body`` from a gradient hook, as the optimizer's hooks run (report() queues a
    callback, which only a running backward takes)."""
    leaf = torch.zeros(1, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(lambda _p: body())  # type: ignore[no-untyped-call]
    leaf.sum().backward()


def _grads(tensors: int) -> list[torch.Tensor]:
    return [torch.full((2, 3), float(j + 1)) for j in range(tensors)]


def _report_all(early: BackwardStart, grads: Sequence[torch.Tensor], order: Sequence[int]) -> None:
    def hooks() -> None:
        for j in order:
            early.report(j, grads[j])

    _in_backward(hooks)


def test_a_hook_that_starts_no_bucket_dispatches_nothing() -> None:
    early, _ = _start()
    grads = _grads(6)
    counts: list[tuple[int, int]] = []  # (buckets started, operations) per hook

    def hooks() -> None:
        for j in (5, 3, 2, 0, 1, 4):
            with CountOps() as ops:
                before = early.started
                early.report(j, grads[j])
            counts.append((early.started - before, sum(ops.ops.values())))

    _in_backward(hooks)
    # Tensor 1 completes bucket 0, then 1 and 2 (2 and 3 are in); 4 completes bucket 3.
    assert [started for started, _ in counts] == [0, 0, 0, 0, 3, 1]
    assert all(ops == 0 for started, ops in counts if not started), counts
    assert all(ops > 0 for started, ops in counts if started), counts


def test_norms_once_per_hook_that_starts_buckets() -> None:
    early, phase = _start()
    grads = _grads(6)
    with mock.patch.object(torch, "_foreach_norm", wraps=torch._foreach_norm) as norm:
        _report_all(early, grads, (5, 3, 2, 0, 1, 4))
    # Tensor 1 starts buckets 0-2: one call for tensors 0-3; tensor 4 starts bucket 3.
    assert [[t.sum().item() for t in c.args[0]] for c in norm.call_args_list] == [
        [6.0, 12.0, 18.0, 24.0],
        [30.0, 36.0],
    ]
    expected = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    assert torch.equal(early._norms, expected[early._order])
    assert [index for index, _ in phase.reads] == [0, 1, 2, 3]


def test_a_gradient_edited_after_its_bucket_started_is_redone() -> None:
    early, _ = _start()
    grads = _grads(6)
    _report_all(early, grads, (0, 1))  # bucket 0 starts
    assert early.started == 1
    assert early.changed(grads) == 0
    grads[1].mul_(0.5)
    assert early.changed(grads) == 1


def test_only_the_gradients_of_started_buckets_are_compared() -> None:
    """A gradient whose bucket has not started is read at step(): its edits, and its
    replacement by another tensor, are no reason to redo."""
    early, _ = _start()
    grads = _grads(6)
    _report_all(early, grads, (0, 1, 4))  # bucket 0 starts; 4's bucket waits for 5
    assert early.started == 1
    grads[4].mul_(0.5)
    assert early.changed(grads) == 0
    replaced = list(grads)
    replaced[4] = grads[4].clone()
    assert early.changed(replaced) == 0
    replaced[0] = grads[0].clone()
    assert early.changed(replaced) == 1


def test_an_edit_before_the_bucket_starts_is_read_not_redone() -> None:
    """A later hook edits tensor 2's gradient before its bucket starts: the bucket reads the
    edit and the step keeps it."""
    early, phase = _start()
    grads = _grads(6)

    def hooks() -> None:
        early.report(2, grads[2])
        grads[2].mul_(0.5)  # as a hook registered after the optimizer's would
        early.report(0, grads[0])
        early.report(1, grads[1])

    _in_backward(hooks)
    assert early.started == 2
    assert phase.reads[1] == (1, [0.5 * 3 * 6])
    assert early.changed(grads) == 0


def test_a_second_report_restarts_and_abandon_forgets() -> None:
    early, phase = _start()
    grads = _grads(6)
    _report_all(early, grads, (0, 1, 1))  # bucket 0 starts, then 1 reports again
    assert early.restarts == 1
    assert early.started == 0  # dropped; 0 alone does not start bucket 0 again
    _report_all(early, grads, (0,))
    assert early.started == 1
    early.abandon()
    _report_all(early, grads, (5,))  # a fresh step: not a second report
    early.abandon()
    _report_all(early, grads, (5,))
    assert early.restarts == 1
    assert [index for index, _ in phase.reads] == [0, 0]


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.ones(3), torch.ones(2, dtype=torch.float64), torch.ones(4, 4).t(), torch.ones(5)],
        [torch.arange(6.0).view(2, 3)[:, ::2], torch.zeros(0), torch.full((3,), 2.0)],
    ],
    ids=["dtypes", "strided_and_empty"],
)
def test_fp64_norms_keep_order_and_group_by_route(tensors: list[torch.Tensor]) -> None:
    """Mixed dtypes and layouts: each norm in place, from a list of contiguous tensors of one
    dtype or alone (the lists whose route is the tensor's own)."""
    with mock.patch.object(torch, "_foreach_norm", wraps=torch._foreach_norm) as norm:
        norms = backward._fp64_norms(tensors)
    expected = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(norms, expected, strict=True))
    for call in norm.call_args_list:
        listed = call.args[0]
        assert len(listed) == 1 or all(
            t.is_contiguous() and t.dtype == listed[0].dtype for t in listed
        )
