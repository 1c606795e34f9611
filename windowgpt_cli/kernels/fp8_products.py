"""Matrix products of a training step in float8 (e4m3), through cuBLAS (`torch._scaled_mm`).

Each operand is rounded to float8 with one scale per row of the product's reduction (a
power of two, so that scaling itself rounds nothing), and the product accumulates in float32
and comes back in the activations' dtype. `fp8_linear` is F.linear's counterpart for
training: its forward and the gradient to its input run in float8, at twice a Hopper GPU's
bfloat16 rate; the weight's gradient, which sums over every row of the batch, stays in
bfloat16. Plain torch (no Triton): torch.compile fuses the rounding into the kernels around it.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
ALIGNMENT = 16  # cuBLAS's float8 products take dimensions in multiples of 16
SMALLEST_AMAX = 1e-30  # the floor of a row's largest magnitude: an all-zero row gets a finite scale


def to_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, C] as float8 codes [R, C] and a float32 scale per row [R, 1], a power of two:
    x ~ codes * scale, each row's largest magnitude within float8's range."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(SMALLEST_AMAX)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_product(a8: Tensor, a_scale: Tensor, b8: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                   fast_accumulation: bool = False) -> Tensor:
    """(a8 * a_scale) @ (b8 * b_scale).T for float8 codes a8 [M, K] and b8 [N, K] with their
    scales per row ([M, 1], [N, 1]), in out_dtype. fast_accumulation: cuBLAS's faster, less
    exact accumulation (the forward's)."""
    return torch._scaled_mm(a8, b8.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1), out_dtype=out_dtype,
                            use_fast_accum=fast_accumulation)


def fp8_product(a: Tensor, b_rows: Tensor, fast_accumulation: bool = False) -> Tensor:
    """a [M, K] @ b_rows.T for b_rows [N, K], both rounded to float8 by rows of K; in a's
    dtype (`scaled_product`)."""
    return scaled_product(*to_fp8_rows(a), *to_fp8_rows(b_rows), a.dtype, fast_accumulation)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return fp8_product(x, weight, fast_accumulation=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = fp8_product(grad, weight.t().contiguous()) if ctx.needs_input_grad[0] else None
        grad_weight = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


def fp8_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether F.linear(x, weight) can run as `fp8_linear`: floating operands of one dtype
    (bfloat16 on CUDA, whose products with a scale per row return bfloat16 only), both
    dimensions of the weight multiples of ALIGNMENT."""
    return (x.dtype == weight.dtype and x.dtype.is_floating_point and weight.ndim == 2
            and (x.device.type != "cuda" or x.dtype == torch.bfloat16)
            and x.shape[-1] == weight.shape[1] and all(n % ALIGNMENT == 0 for n in weight.shape))


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """F.linear(x, weight) (no bias) for x [..., K] and weight [N, K] (`fp8_fits`), the
    forward and the gradient to x in float8, the weight's gradient in x's dtype."""
    if not fp8_fits(x, weight):
        raise ValueError(f"x [..., K] and weight [N, K] of one float dtype (bfloat16 on CUDA), N and K multiples of "
                         f"{ALIGNMENT}: got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _Fp8Linear.apply(rows, weight.contiguous()).reshape(*x.shape[:-1], weight.shape[0])


@functools.cache
def fp8_available(device: torch.device) -> bool:
    """Whether float8 products run on `device`: a GPU of compute capability 8.9 (Ada,
    Hopper) or later, or a CPU whose torch has them; tried once on a small product."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        ones = torch.ones(ALIGNMENT, ALIGNMENT, device=device, dtype=torch.bfloat16)
        fp8_product(ones, ones, fast_accumulation=True)
    except (RuntimeError, NotImplementedError):
        return False
    return True
