"""The MLP of a training step in float8 (`fp8_leaky_square_mlp`, for `train --fp8-mlp`), with
LeakyReLU² and the rounding of its rows to float8 in one Triton kernel each way.

The down product's operand is the activation, rounded to float8 with one scale per row of
mlp_dim columns; that scale needs the row's largest magnitude before any code is written.
Left to the compiler, the activation and its rounding become a reduction kernel that reads
each row of 1,536 columns twice (Inductor holds a row whole in registers only up to 1,024
columns) and runs at about half the memory's speed. Here one program holds a few rows
whole: it reads the product once and writes the activation (kept for the down weight's
gradient), its float8 codes and the rows' scales; in the backward it reads the activation's
gradient and the product once and writes the product's gradient, its codes and scales.
Their results equal `fp8_products.to_fp8_rows` of the activation and of the gradient.

Codes are rounded to float8's grid by integer steps on float32 bits, ties to even, and only
then converted (exactly): Triton's interpreter, which runs these kernels in the CPU tests,
converts a value just under a power of two to the binade below.
Importing this module imports Triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .elementwise import leaky_square_values
from .elementwise_backward import leaky_square_derivative
from .fp8_products import FP8, FP8_MAX, SMALLEST_AMAX, fp8_fits, fp8_product, scaled_product, to_fp8_rows

CODE_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
AMAX_FLOOR: tl.constexpr = tl.constexpr(SMALLEST_AMAX)

# --- Kernels -----------------------------------------------------------------------------


@triton.jit
def _power_of_two_at_least(r):
    """The smallest power of two >= r, and its inverse, for positive normal float32 r, from
    its bits (the inverse exact, where dividing by it would be rounded as Triton divides)."""
    bits = r.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True), ((254 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_grid(v):
    """v (float32, |v| <= 448) at the nearest float8 e4m3 value, ties to even: 3 bits of
    mantissa for normal values; below 2^-6 multiples of 2^-9 (adding 1.5 * 2^14 rounds there)."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # -0x100000: the mask 0xFFF00000
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _program_rows(rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    """This program's rows [ROWS, 1], the offsets of their elements [ROWS, COLS] in a
    contiguous [rows, cols] tensor, and which of those exist."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, COLS)[None, :]
    return row, row.to(tl.int64) * cols + col, (row < rows) & (col < cols)


@triton.jit
def fp8_row_codes(x):
    """x [ROWS, COLS] (float32) rounded to float8 by rows with a power-of-two scale each, as
    `to_fp8_rows`: (the codes, float32 values on float8's grid; the scales [ROWS, 1])."""
    amax = tl.max(tl.abs(x), axis=1, keep_dims=True)
    # a correctly rounded division, as torch's: Triton's `/` is approximate, and a row whose
    # largest magnitude is 448 times a power of two must get that power, not the next
    scale, inverse = _power_of_two_at_least(tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), CODE_MAX))
    return _e4m3_grid(tl.minimum(tl.maximum(x * inverse, -CODE_MAX), CODE_MAX)), scale


@triton.jit
def _store_fp8_rows(x, codes_ptr, scale_ptr, row, offsets, mask, rows):
    """Round x [ROWS, COLS] (float32, 0 where masked) to float8 codes by rows (`fp8_row_codes`)
    and store codes and scales."""
    codes, scale = fp8_row_codes(x)
    tl.store(codes_ptr + offsets, codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale, mask=row < rows)


@triton.jit(do_not_specialize=["rows"])
def _leaky_square_fp8_kernel(h_ptr, a_ptr, codes_ptr, scale_ptr, rows, cols, negative_slope,
                             ROWS: tl.constexpr, COLS: tl.constexpr):
    row, offsets, mask = _program_rows(rows, cols, ROWS, COLS)
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    a = leaky_square_values(h, negative_slope).to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + offsets, a, mask=mask)
    _store_fp8_rows(a.to(tl.float32), codes_ptr, scale_ptr, row, offsets, mask, rows)


@triton.jit(do_not_specialize=["rows"])
def _leaky_square_fp8_backward_kernel(grad_ptr, h_ptr, dh_ptr, codes_ptr, scale_ptr, rows, cols, negative_slope,
                                      ROWS: tl.constexpr, COLS: tl.constexpr):
    row, offsets, mask = _program_rows(rows, cols, ROWS, COLS)
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dh = leaky_square_derivative(h, grad, negative_slope).to(dh_ptr.dtype.element_ty)
    tl.store(dh_ptr + offsets, dh, mask=mask)
    _store_fp8_rows(dh.to(tl.float32), codes_ptr, scale_ptr, row, offsets, mask, rows)


# --- Ops ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowLaunch:
    """How the kernels cut their rows: each program holds rows of `elements` lanes in all
    (a row takes the power of two at or above its columns: 2,048 lanes for 1,536), with
    `warps` warps. The default, a row of up to 2,048 lanes in two warps, was the fastest cut on
    an H200 at 1,536 and 2,048 columns (bench/results/fp8_mlp_speed_h200.json)."""

    elements: int = 2048
    warps: int = 2

    def grid_and_options(self, h: Tensor) -> tuple[tuple[int], dict]:
        cols = triton.next_power_of_2(h.size(1))
        rows = max(1, self.elements // cols)
        return (triton.cdiv(h.size(0), rows),), {"ROWS": rows, "COLS": cols, "num_warps": self.warps}


def _codes_and_scales(h: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty(h.shape, device=h.device, dtype=FP8), torch.empty(h.size(0), 1, device=h.device,
                                                                         dtype=torch.float32)


def leaky_square_fp8_rows(h: Tensor, negative_slope: float,
                          launch: RowLaunch = RowLaunch()) -> tuple[Tensor, Tensor, Tensor]:
    """For h [rows, cols]: a = leaky_relu(h)² in h's dtype, and a's float8 codes [rows, cols]
    and scales [rows, 1] (`to_fp8_rows(a)`)."""
    h = h.contiguous()
    a = torch.empty_like(h)
    codes, scale = _codes_and_scales(h)
    grid, options = launch.grid_and_options(h)
    _leaky_square_fp8_kernel[grid](h, a, codes, scale, h.size(0), h.size(1), negative_slope, **options)
    return a, codes, scale


def leaky_square_fp8_backward_rows(grad: Tensor, h: Tensor, negative_slope: float,
                                   launch: RowLaunch = RowLaunch()) -> tuple[Tensor, Tensor, Tensor]:
    """For the gradient of a = leaky_relu(h)² and h [rows, cols]: h's gradient in h's dtype,
    and its float8 codes and scales (`to_fp8_rows` of it)."""
    grad, h = grad.contiguous(), h.contiguous()
    dh = torch.empty_like(h)
    codes, scale = _codes_and_scales(h)
    grid, options = launch.grid_and_options(h)
    _leaky_square_fp8_backward_kernel[grid](grad, h, dh, codes, scale, h.size(0), h.size(1), negative_slope,
                                            **options)
    return dh, codes, scale


# The ops a compiled step sees (opaque to the compiler; their fake implementations give the shapes).
@torch.library.custom_op("windowgpt::leaky_square_fp8", mutates_args=())
def leaky_square_fp8(h: Tensor, negative_slope: float) -> tuple[Tensor, Tensor, Tensor]:
    return leaky_square_fp8_rows(h, negative_slope)


@leaky_square_fp8.register_fake
def _leaky_square_fp8_shapes(h, negative_slope):
    return torch.empty_like(h), *_codes_and_scales(h)


@torch.library.custom_op("windowgpt::leaky_square_fp8_backward", mutates_args=())
def leaky_square_fp8_backward(grad: Tensor, h: Tensor, negative_slope: float) -> tuple[Tensor, Tensor, Tensor]:
    return leaky_square_fp8_backward_rows(grad, h, negative_slope)


@leaky_square_fp8_backward.register_fake
def _leaky_square_fp8_backward_shapes(grad, h, negative_slope):
    return torch.empty_like(h), *_codes_and_scales(h)


class _Fp8Mlp(torch.autograd.Function):
    """The MLP's two products in float8 as `fp8_products.fp8_linear` runs each, the activation
    and its derivative with their rows' rounding in the kernels above."""

    @staticmethod
    def forward(ctx, x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
        h = fp8_product(x, up_w, fast_accumulation=True)
        a, a8, a_scale = leaky_square_fp8(h, negative_slope)
        ctx.save_for_backward(x, up_w, down_w, h, a)
        ctx.negative_slope = negative_slope
        return scaled_product(a8, a_scale, *to_fp8_rows(down_w), x.dtype, fast_accumulation=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, up_w, down_w, h, a = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = fp8_product(grad, down_w.t().contiguous())
        grad_h, grad_h8, grad_h_scale = leaky_square_fp8_backward(grad_a, h, ctx.negative_slope)
        grad_x = scaled_product(grad_h8, grad_h_scale, *to_fp8_rows(up_w.t().contiguous()), grad.dtype)
        return grad_x, grad_h.t().mm(x), grad.t().mm(a), None


def fp8_mlp_fits(x: Tensor, up_w: Tensor, down_w: Tensor) -> bool:
    """Whether `fp8_leaky_square_mlp` takes these operands: each product as `fp8_fits` asks."""
    return fp8_fits(x, up_w) and down_w.shape == (up_w.size(1), up_w.size(0)) and down_w.dtype == x.dtype


def fp8_leaky_square_mlp(x: Tensor, up_w: Tensor, down_w: Tensor, negative_slope: float) -> Tensor:
    """F.linear(leaky_relu(F.linear(x, up_w), negative_slope)², down_w) for x [..., dim],
    up_w [mlp_dim, dim] and down_w [dim, mlp_dim] (`fp8_mlp_fits`): both products and the
    gradients to their inputs in float8, the weights' gradients in x's dtype."""
    if not fp8_mlp_fits(x, up_w, down_w):
        raise ValueError(f"x [..., dim], up_w [mlp_dim, dim] and down_w [dim, mlp_dim] as fp8_fits asks: got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(up_w.shape)} {up_w.dtype} and {tuple(down_w.shape)} "
                         f"{down_w.dtype}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _Fp8Mlp.apply(rows, up_w.contiguous(), down_w.contiguous(), negative_slope)
    return out.reshape(*x.shape[:-1], down_w.size(0))
