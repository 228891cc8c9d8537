"""Turn off the exchange's buffers used as stacks (plan/in_place.py), for tests that compare
a step with and without them: the plan-time argument ``rank`` of ``bucket_map`` withheld."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from muon_dist.plan.bucket_map import BucketMap
from muon_dist.plan.build import BucketPlan
from muon_dist.step.program import binding


@contextmanager
def packed_only() -> Iterator[None]:
    """Every bucket map laid out without the calling rank: every buffer packed. Only steps
    built (optimizers constructed) inside the context are affected."""
    original: Callable[..., BucketMap] = binding.bucket_map

    def packed(
        bucket: BucketPlan,
        first: int,
        world_size: int,
        ranks: Sequence[int],
        rank: int | None = None,
    ) -> BucketMap:
        return original(bucket, first, world_size, ranks)

    binding.bucket_map = packed
    try:
        yield
    finally:
        binding.bucket_map = original
