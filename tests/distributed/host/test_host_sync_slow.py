"""The slow tier of test_host_sync.py: a sharded steady-state step on two ranks reads no
device value either."""

from __future__ import annotations

from dist_harness import run_distributed
from test_host_sync import distributed_worker


def test_sharded_steady_state_step_reads_no_device_value() -> None:
    for calls in run_distributed(2, distributed_worker, timeout=180):
        assert calls == [[], []]
