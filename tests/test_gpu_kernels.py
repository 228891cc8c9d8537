"""Check the Triton Newton–Schulz kernels on a CUDA GPU, where bf16 can be tested.

The CPU tests run Triton's interpreter in fp32 only; this covers what they cannot: bf16 and
fp16 tensor-core products, compiled masking on shapes off the tile sizes, a batch past
2**31 elements (64-bit offsets), and the full iteration in bf16, whose error against
float64 must be at most 1.5x the torch bf16 reference's on the same input, never NaN. It
also checks the fused momentum and update passes against torch's adds with bf16 state and
outputs, and past 2**31 elements. Exits 1 on any failure.

    python scripts/check_kernels_gpu.py
"""

from __future__ import annotations

import sys

import torch
from bench_kernels import MAX_ERROR_RATIO, newton_schulz_float64, rel_err

from muon_dist.kernels import newton_schulz
from muon_dist.kernels.coefficients import COEFFICIENT_SETS
from muon_dist.kernels.elementwise import advance_momentum
from muon_dist.kernels.triton_elementwise import decay_and_update_triton, momentum_input_triton
from muon_dist.kernels.triton_kernels import sym_product

# Product tolerances against float64: fp32 is exact-product ("ieee"), bf16/fp16 round once.
PRODUCT_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
PRODUCT_SHAPES = [(1, 300, 700), (3, 129, 1000), (2, 1, 64), (5, 257, 513), (1, 2048, 2048)]
NS_SHAPES = [(300, 700), (1000, 129), (3, 257, 513), (2, 1536, 1024), (7, 96, 96), (4096, 4096)]


def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"{'ok ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def check_products(failures: list[str]) -> None:
    """Every output element is written (NaN poison) and both products match float64."""
    for dtype, tol in PRODUCT_TOL.items():
        for shape in PRODUCT_SHAPES:
            batch, m, _ = shape
            # Unit-scale entries keep A·A inside fp16's range.
            P = (torch.randn(shape, device="cuda") / shape[-1] ** 0.5).to(dtype)
            out = torch.full((batch, m, m), float("nan"), device="cuda", dtype=dtype)
            sym_product(P, out=out)
            err = rel_err(out, P.double() @ P.double().mT)
            check(
                f"gram {dtype} {shape}", err < tol and not out.isnan().any(), f"{err:.2e}", failures
            )

            A = out
            poly = torch.full_like(A, float("nan"))
            sym_product(A, out=poly, alpha=2.03, Y=A, beta=-4.78)
            ref = 2.03 * A.double() @ A.double() - 4.78 * A.double()
            err = rel_err(poly, ref)
            ok = err < tol and not poly.isnan().any()
            check(f"poly {dtype} {shape}", ok, f"{err:.2e}", failures)

            # The first Newton–Schulz step's epilogue: a scale per matrix and a diagonal.
            scale = torch.rand(batch, device="cuda") + 0.5
            sym_product(A, out=poly, alpha=2.03, Y=A, beta=-4.78, diag=3.44, scale=scale)
            eye = torch.eye(m, device="cuda", dtype=torch.float64)
            ref = (ref + 3.44 * eye) * scale.double().view(-1, 1, 1)
            err = rel_err(poly, ref)
            ok = err < tol and not poly.isnan().any()
            check(f"scaled poly {dtype} {shape}", ok, f"{err:.2e}", failures)


def check_large_batch(failures: list[str]) -> None:
    """A batch of 2**31+ elements: only 64-bit batch offsets reach the last matrices."""
    batch, m, k = 33, 8192, 8192
    P = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, m, m, device="cuda", dtype=torch.bfloat16)
    sym_product(P, out=out)
    for index in (0, batch - 1):
        ref = P[index].float() @ P[index].float().mT
        err = rel_err(out[index], ref.double())
        check(f"gram batch {batch}x{m}x{k}[{index}]", err < 1e-2, f"{err:.2e}", failures)


def check_newton_schulz(failures: list[str]) -> None:
    for coefficients in sorted(COEFFICIENT_SETS):
        for shape in NS_SHAPES:
            X = torch.randn(shape, device="cuda")
            ref = newton_schulz_float64(X, 5, coefficients)
            torch_err = rel_err(newton_schulz(X, 5, coefficients, backend="torch"), ref)
            out = newton_schulz(X, 5, coefficients, backend="triton")
            ok = out.dtype == torch.bfloat16 and out.shape == X.shape and not out.isnan().any()
            triton_err = rel_err(out, ref)
            ok = ok and triton_err <= MAX_ERROR_RATIO * torch_err
            detail = f"triton {triton_err:.2e} torch {torch_err:.2e}"
            check(f"ns {coefficients} {shape}", ok, detail, failures)
    zeros = torch.zeros(3, 200, 100, device="cuda")
    out = newton_schulz(zeros, backend="triton")
    check("ns zeros", bool((out == 0).all()), "zero input gives zeros", failures)


def _close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Equal up to two roundings to ``dtype`` at the tensor's scale: the fused pass rounds
    once where torch's adds may round an intermediate to the state dtype first."""
    diff = (out.float() - expected.float()).abs().max().item()
    bound = 2 * torch.finfo(dtype).eps * expected.float().abs().max().item()
    return diff <= bound, f"max diff {diff:.2e} (bound {bound:.2e})"


def check_elementwise(failures: list[str]) -> None:
    for state_dtype in (torch.float32, torch.bfloat16):
        for out_dtype in (torch.bfloat16, torch.float32):
            for mix in (0.95, None):
                grad = torch.randn(3, 1000, 1001, device="cuda", dtype=state_dtype)
                momentum = torch.randn_like(grad)
                advanced = advance_momentum(grad, momentum, 0.9)
                expected = advanced if mix is None else torch.add(grad, advanced, alpha=mix)
                out = torch.empty_like(grad, dtype=out_dtype)
                momentum_input_triton(grad, momentum, out, 0.9, mix, store=True)
                coarse = torch.bfloat16 if torch.bfloat16 in (state_dtype, out_dtype) else out_dtype
                ok, detail = _close(out, expected.to(out_dtype), coarse)
                stored, _ = _close(momentum, advanced, state_dtype)
                name = f"momentum {state_dtype}->{out_dtype} mix={mix}"
                check(name, ok and stored, detail, failures)
        param = torch.randn(5, 777, 513, device="cuda", dtype=state_dtype)
        update = torch.randn_like(param, dtype=torch.bfloat16)
        expected = param.mul(0.998).add_(update, alpha=-0.02)
        decay_and_update_triton(param, update, 0.998, -0.02)
        check(f"update {state_dtype}", *_close(param, expected, state_dtype), failures)
    # 64-bit offsets: the last elements of a tensor past 2**31 elements.
    numel = 2**31 + 4100
    grad = torch.ones(numel, device="cuda")
    momentum = torch.full_like(grad, 2.0)
    out = torch.zeros(numel, device="cuda", dtype=torch.bfloat16)
    momentum_input_triton(grad, momentum, out, 0.5, 1.0, store=True)
    tail_ok = bool((out[-5000:] == 3.0).all() and (momentum[-5000:] == 2.0).all())
    check("momentum past 2**31 elements", tail_ok, "last 5000 elements written", failures)
    del grad, momentum, out


def main() -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("check_kernels_gpu.py checks CUDA kernels; run it on a GPU machine")
    torch.manual_seed(0)
    failures: list[str] = []
    check_products(failures)
    check_newton_schulz(failures)
    check_large_batch(failures)
    check_elementwise(failures)
    print(f"{len(failures)} failures" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
