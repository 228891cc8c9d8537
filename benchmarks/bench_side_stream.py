"""Would a side stream hide the step's memory-bound passes behind Newton–Schulz? One GPU.

    PYTHONPATH=$PWD python3 benchmarks/bench_side_stream.py

Times, by CUDA events (median of 20 after 3 warm-up rounds), one bucket-sized round of
Newton–Schulz (one 14336×4096 matrix, the Gram iteration, and two 4096² ones) and one of the
fused momentum-and-inputs and decay-and-update passes over 44 M fp32 elements (about one
llama-8B MLP bucket's local pieces at 4 GPUs), each alone, back to back on one stream, and
with the passes on a side stream beside Newton–Schulz. The step runs them on one stream;
"concurrent" below "serial" would make a side stream worth building.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from muon_dist.kernels.dispatch import newton_schulz
from muon_dist.kernels.triton_elementwise import decay_and_updates_triton, momentum_inputs_triton

ELEMENTS = 4096 * 14336 * 3 // 4


def timed(fn: Callable[[], None], reps: int = 20) -> float:
    """Median ms of ``fn`` by CUDA events on the current stream, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    stacks = [
        torch.randn(1, 14336, 4096, device=device, dtype=torch.bfloat16),
        torch.randn(2, 4096, 4096, device=device, dtype=torch.bfloat16),
    ]
    grad, momentum, param = (torch.randn(ELEMENTS, device=device) for _ in range(3))
    inputs = torch.empty(ELEMENTS, device=device, dtype=torch.bfloat16)
    update = torch.randn(ELEMENTS, device=device, dtype=torch.bfloat16)
    keep = torch.ones((), device=device, dtype=torch.bool)
    decay = torch.ones((), device=device)
    step = torch.full((), -1e-3, device=device)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def orthogonalize() -> None:
        for stack in stacks:
            newton_schulz(stack)

    def passes() -> None:
        momentum_inputs_triton([grad], [momentum], [inputs], 0.95, 0.95, True, [keep])
        decay_and_updates_triton([param], [update], [decay], [step], [keep], [None])

    def serial() -> None:
        orthogonalize()
        passes()

    def concurrent() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            passes()
        orthogonalize()
        torch.cuda.current_stream().wait_stream(side)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per round")
    print("| Newton–Schulz | passes | serial | concurrent |")
    print("| --- | --- | --- | --- |")
    for _ in range(2):
        row = (timed(orthogonalize), timed(passes), timed(serial), timed(concurrent))
        print("| " + " | ".join(f"{t:.3f}" for t in row) + " |")


if __name__ == "__main__":
    main()
