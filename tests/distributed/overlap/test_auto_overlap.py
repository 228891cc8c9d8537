"""overlap="auto": the schedule and the choice (pure), the agreed choice on every rank with
scripted clocks, and bitwise parity with the plain mode across warm-up, trials, decision,
rebuilt steps and a state load (cases in overlap_cases.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch
from dist_harness import run_distributed
from overlap_cases import AUTO_TIMES, ScriptedClock, overlap_worker
from torch import nn

import muon_dist
from muon_dist.comm.groups import CommGroups, Peers
from muon_dist.options.schema import SETTINGS
from muon_dist.step.launch import auto_overlap
from muon_dist.step.launch.auto_overlap import (
    BACKWARD,
    DECISION_STEP,
    NONE,
    TRIAL_STEPS,
    TRIALS_PER_MODE,
    WARMUP_STEPS,
    choose,
    marked,
    medians,
    trial_mode,
)
from muon_dist.step.launch.overlap_choice import HostClock, OverlapChoice

ALONE = CommGroups(0, 1, Peers((0,), None), Peers((0,), None))


def _expected_overlapping(chosen: str, steps: int) -> list[bool]:
    return [(trial_mode(t) or chosen) == BACKWARD for t in range(steps)]


def test_warmup_is_plain_then_trials_alternate_in_counterbalanced_blocks() -> None:
    modes = [trial_mode(t) for t in range(DECISION_STEP + 3)]
    assert modes[:WARMUP_STEPS] == [NONE] * WARMUP_STEPS
    trials = modes[WARMUP_STEPS : DECISION_STEP + 1]
    assert len(trials) == TRIAL_STEPS
    assert trials.count(NONE) == trials.count(BACKWARD) == TRIALS_PER_MODE
    assert modes[DECISION_STEP + 1 :] == [None, None], "the choice holds after the decision"
    # A linear drift moves both modes' median positions alike.
    positions = {m: [i for i, x in enumerate(trials) if x == m] for m in (NONE, BACKWARD)}
    assert medians([float(i) for i in range(TRIAL_STEPS)]) == {
        m: sum(p[len(p) // 2 - 1 : len(p) // 2 + 1]) / 2 for m, p in positions.items()
    }
    assert len(set(medians([float(i) for i in range(TRIAL_STEPS)]).values())) == 1


def test_marks_are_the_first_trials_start_and_every_trials_end() -> None:
    marks = [t for t in range(DECISION_STEP + 3) if marked(t)]
    assert marks == list(range(WARMUP_STEPS - 1, DECISION_STEP + 1))
    assert len(marks) == TRIAL_STEPS + 1


def _times(none_s: float, backward_s: float, outlier: float = 0.0) -> list[float]:
    times = [none_s if trial_mode(WARMUP_STEPS + i) == NONE else backward_s for i in range(8)]
    times[0] += outlier  # one slow step (a checkpoint, a first use) per mode moves no median
    times[1] += outlier
    return times


@pytest.mark.parametrize(
    ("none_s", "backward_s", "chosen"),
    [(1.0, 0.8, BACKWARD), (0.8, 1.0, NONE), (1.0, 1.0, NONE), (1.0, float("nan"), NONE)],
    ids=["overlap_faster", "plain_faster", "tie_keeps_plain", "nan_keeps_plain"],
)
def test_the_faster_median_is_chosen_and_a_tie_keeps_plain(
    none_s: float, backward_s: float, chosen: str
) -> None:
    per_mode = medians(_times(none_s, backward_s, outlier=5.0))
    assert choose(per_mode[NONE], per_mode[BACKWARD]) == chosen


def test_medians_need_every_trial() -> None:
    with pytest.raises(ValueError, match=r"overlap='auto' times 8 trial steps, and got 7"):
        medians([1.0] * 7)


def test_ranks_that_would_choose_differently_agree_on_the_slowest() -> None:
    """Each rank alone would choose its own way; the choice from the MAX over ranks of each
    mode's median (what the all-reduce gives every rank) is one choice for all."""
    ranks = [
        medians(_times(**t))
        for t in ({"none_s": 1.0, "backward_s": 0.9}, {"none_s": 0.8, "backward_s": 1.2})
    ]
    assert {choose(r[NONE], r[BACKWARD]) for r in ranks} == {NONE, BACKWARD}
    slowest = {m: max(r[m] for r in ranks) for m in (NONE, BACKWARD)}
    assert choose(slowest[NONE], slowest[BACKWARD]) == NONE


def test_the_option_text_states_the_schedule() -> None:
    (overlap,) = [o for o in SETTINGS if o.key == "overlap"]
    assert f"times {TRIALS_PER_MODE} steps of each mode after {WARMUP_STEPS}" in overlap.meaning


def _ended(choice: OverlapChoice, steps: int) -> list[bool]:
    overlapping = []
    for _ in range(steps):
        overlapping.append(choice.overlapping)
        choice.step_ended(ALONE)
    return overlapping


@pytest.mark.parametrize("seconds", [{NONE: 1.0, BACKWARD: 0.5}, {NONE: 0.5, BACKWARD: 1.0}])
def test_one_rank_measures_then_keeps_its_choice(
    seconds: dict[str, float], caplog: pytest.LogCaptureFixture
) -> None:
    choice = OverlapChoice("auto", torch.device("cpu"))
    assert isinstance(choice.clock, HostClock)
    choice.clock = ScriptedClock(seconds)
    assert choice.mode == "measuring"
    chosen = min(seconds, key=lambda m: seconds[m])
    with caplog.at_level(logging.INFO, logger="muon_dist.step.launch.overlap_choice"):
        overlapping = _ended(choice, DECISION_STEP + 1)
        assert choice.mode == chosen and choice.medians == seconds
        overlapping += _ended(choice, 5)
    assert overlapping == _expected_overlapping(chosen, DECISION_STEP + 6)
    (record,) = caplog.records
    ratio = seconds[BACKWARD] / seconds[NONE]
    assert f"chose overlap='{chosen}'" in record.message and f"({ratio:.3f}x)" in record.message


@pytest.mark.parametrize("setting", [NONE, BACKWARD])
def test_a_fixed_setting_is_its_mode_from_the_start(setting: str) -> None:
    choice = OverlapChoice(setting, torch.device("cpu"))
    assert choice.mode == setting
    assert _ended(choice, DECISION_STEP + 2) == [setting == BACKWARD] * (DECISION_STEP + 2)
    assert choice.medians is None


def test_the_host_clock_times_between_marks() -> None:
    clock = HostClock()
    for _ in range(3):
        clock.mark()
    seconds = clock.seconds()
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)


def test_auto_is_refused_where_backward_is() -> None:
    weight = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(
        ValueError, match=r"overlap='auto' starts Newton-Schulz .* use cuda_graph='auto'"
    ):
        muon_dist.Muon([weight], overlap="auto", cuda_graph=True)
    model = nn.Linear(4, 4, bias=False)
    with pytest.raises(ValueError, match=r"overlap='auto': weight is a plain tensor"):
        muon_dist.Muon([{"params": [model.weight], "param_names": ["weight"]}], overlap="auto")


def _agreed(outs: Sequence[dict[str, object]], key: str) -> object:
    values = [out[key] for out in outs]
    assert all(v == values[0] for v in values), (key, values)
    return values[0]


@pytest.mark.parametrize(
    ("scenario", "chosen"),
    [("overlap_faster", BACKWARD), ("plain_faster", NONE), ("ranks_differ", NONE), ("tie", NONE)],
)
def test_every_rank_takes_the_agreed_choice(scenario: str, chosen: str) -> None:
    outs = run_distributed(2, overlap_worker, "auto_choice", scenario)
    assert _agreed(outs, "chosen") == chosen
    times = AUTO_TIMES[scenario]
    assert _agreed(outs, "medians") == {m: max(t[m] for t in times) for m in (NONE, BACKWARD)}
    steps = DECISION_STEP + 3
    expected = _expected_overlapping(chosen, steps)
    for rank, out in enumerate(outs):
        assert out["overlapping"] == expected, (rank, out)
        # Buckets start during backward exactly in the overlapped steps.
        assert [count > 0 for count in out["started"]] == expected, (rank, out)
        assert out["modes"] == ["measuring"] * (DECISION_STEP + 1) + [chosen] * 2, (rank, out)
        # Host reads: an overlapped step's redo flag, and the medians at the decision.
        reads = [int(o) + (t == DECISION_STEP) for t, o in enumerate(expected)]
        assert out["reads"] == reads, (rank, out)


def test_auto_is_bitwise_equal_to_plain_across_the_decision_rebuilt_and_raised_steps() -> None:
    for rank, out in enumerate(run_distributed(2, overlap_worker, "auto_parity")):
        assert out["equal"], f"rank {rank}: parameters or state differ"
        assert out["mode"] == BACKWARD and out["steps"] == DECISION_STEP + 1, out
        # Two rebuilt steps (the ns_steps edit, the load) kept the count and the choice.
        assert out["runners"] == 3, out
        started, raised = out["started"], out["raised_step"]
        overlapped = _expected_overlapping(BACKWARD, len(started))
        # The step after the raised one is plain: its hooks start nothing, and what the
        # raised step left open stays so until its step() drops it.
        assert started[raised + 1] == started[raised] > 0, out
        started[raised + 1] = 0
        assert [count > 0 for count in started] == overlapped, out


def test_the_auto_module_is_pure() -> None:
    """The schedule and choice import nothing of torch or of the package: unit-testable
    without processes or devices."""
    source = auto_overlap.__file__
    assert source is not None
    with open(source) as f:
        imports = [line for line in f if line.startswith(("import ", "from "))]
    assert all("torch" not in line and "muon_dist" not in line for line in imports), imports
