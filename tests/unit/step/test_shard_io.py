"""Where each view's shard read, write, momentum, decay and Dion2's feedback happen: the
record decided at bind time, and its table."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import muon_dist
from muon_dist.step.shard.modes import StepMode
from muon_dist.step.shard.shard_io import (
    DECAY_CAUTIOUS,
    DECAY_IN_WRITE,
    DECAY_TENSOR,
    FEEDBACK_BESIDE,
    FEEDBACK_IN_WRITE,
    FEEDBACK_NONE,
    MOMENTUM_AT_COMMIT,
    MOMENTUM_BEFORE,
    MOMENTUM_IN_READ,
    READ_FUSED,
    WRITE_BATCHED,
    WRITE_FUSED,
    WRITE_SINGLE,
    Fused,
    format_shard_io_table,
    shard_io,
)


def test_every_combination_has_one_place_for_each_part() -> None:
    """A fused write carries the decay and the feedback; cautious decay and Magma write one
    piece at a time; the momentum advances in the read exactly where the read is fused."""
    for fused_read, fused_write, cautious, magma, feedback in itertools.product(
        (False, True), repeat=5
    ):
        if fused_write and (cautious or magma):
            continue  # the plan never fuses those writes (the update's sign, per-row steps)
        fused = (Fused.READ if fused_read else Fused.NONE) | (
            Fused.WRITE if fused_write else Fused.NONE
        )
        group = {"cautious_wd": cautious, "magma": magma}
        r = shard_io("w", fused, group, object() if feedback else None)
        assert (r.read == READ_FUSED) == fused_read == (r.momentum == MOMENTUM_IN_READ)
        assert (r.momentum == MOMENTUM_BEFORE) != fused_read
        assert r.momentum_at(StepMode.PLAIN) == r.momentum
        held = [m for m in StepMode if m is not StepMode.PLAIN]
        assert {r.momentum_at(m) for m in held} == {MOMENTUM_AT_COMMIT}
        expected_write = (
            WRITE_FUSED if fused_write else WRITE_SINGLE if cautious or magma else WRITE_BATCHED
        )
        assert r.write == expected_write
        expected_decay = (
            DECAY_IN_WRITE if fused_write else DECAY_CAUTIOUS if cautious else DECAY_TENSOR
        )
        assert r.decay == expected_decay
        if not feedback:
            assert r.feedback == FEEDBACK_NONE
        else:
            assert r.feedback == (FEEDBACK_IN_WRITE if fused_write else FEEDBACK_BESIDE)


def test_the_table_has_a_row_per_view_with_its_places() -> None:
    plain, magma, cautious = (nn.Parameter(torch.randn(12, 8)) for _ in range(3))
    split, selected = nn.Parameter(torch.randn(12, 8)), nn.Parameter(torch.randn(8, 12))
    opt = muon_dist.Muon(
        [
            {"params": [plain], "algorithm": "muon"},
            {"params": [magma], "algorithm": "muon", "magma": True},
            {"params": [cautious], "algorithm": "muon", "cautious_wd": True},
            {"params": [split], "algorithm": "muon", "split_sizes": [4, 8]},
            {"params": [selected], "algorithm": "muon", "rule": "dion2"},
        ],
        weight_decay=0.1,
    )
    muon = opt.runner.muon
    assert muon is not None
    records = muon.pieces.forms.io
    assert [r.name for r in records] == [e.view.label(e.name) for e in muon.tensors.entries]
    by_name = {r.name: r for r in records}
    # CPU tensors never take the fused forms.
    assert {r.read for r in records} == {"torch"} and WRITE_FUSED not in {r.write for r in records}
    assert by_name["group1.param0"].write == WRITE_SINGLE
    assert by_name["group1.param0"].decay == DECAY_TENSOR
    assert by_name["group2.param0"].decay == DECAY_CAUTIOUS
    assert by_name["group4.param0"].feedback == FEEDBACK_BESIDE
    assert by_name["group0.param0"].feedback == FEEDBACK_NONE

    lines = muon.shard_io_table().splitlines()
    assert lines[0].split()[0] == "view" and set(lines[1]) <= {"-", " "}
    rows = lines[2 : 2 + len(records)]
    for record, row in zip(records, rows, strict=True):
        assert row.startswith(record.name + " ")
        for cell in (record.read, record.momentum, record.write, record.decay):
            assert cell in row
    assert muon.shard_io_table() == format_shard_io_table(records)
