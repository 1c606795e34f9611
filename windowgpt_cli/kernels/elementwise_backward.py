"""The backward kernels of the fused steps that eager training steps differentiate
(Triton): the per-head norm, rotation and gain of queries and keys (after
`elementwise._head_prep_kernel`), and the MLP's LeakyReLU², alone or as the epilogue of
the product that brings the gradient back through the down projection.
`model.fused_train_ops` and `fused_mlp` wrap them in autograd functions.

Backwards compute in float32 from the stored inputs and round once, to the input's dtype.
Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .elementwise import (
    ELEMENTS,
    FLOAT32_EPS,
    HEAD_LAUNCH,
    HeadLaunch,
    MatmulTiles,
    by_positions,
    evenly_spaced,
    float32_values,
    head_positions,
    head_table_strides,
    pair_partners,
    product_tile,
    programs_for,
    rotary_at,
    tma_ready,
)

# --- Kernels -----------------------------------------------------------------------------

@triton.jit
def summed_copies(grad_ptr, row, copies, col, mask, POSITIONS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The gradient of a head's rows (row: [POSITIONS, 1]) summed over its `copies` copies, in float32."""
    grad = tl.zeros((POSITIONS, HEAD_DIM), dtype=tl.float32)
    for copy in range(copies):
        grad += tl.load(grad_ptr + (row * copies + copy) * HEAD_DIM + col, mask=mask, other=0.0).to(tl.float32)
    return grad


@triton.jit(do_not_specialize=["positions", "heads", "has_gain", "rows_per_seq", "copies"])
def _head_prep_backward_kernel(grad_ptr, x_ptr, cos_ptr, sin_ptr, gain_ptr, dx_ptr, gain_rows_ptr, positions,
                               rows_per_seq, x_stride, dx_stride, cos_seq_stride, cos_row_stride, eps, heads,
                               has_gain, copies, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr,
                               POSITIONS: tl.constexpr):
    """The gradient of `_head_prep_kernel` (of its `copies` copies of each head, whose
    gradients add up) for every head at POSITIONS positions: with respect to x (stored in
    dx's dtype) and, if has_gain, each row's (head's at a position) share of its head's gain
    gradient (float32). x's positions lie x_stride elements apart, as in the forward, and dx's
    dx_stride (a slice of a gradient that holds other heads too)."""
    position, col, live, seq, pos = head_positions(positions, rows_per_seq, HEAD_DIM, POSITIONS)
    cos, sin = rotary_at(cos_ptr, sin_ptr, seq, pos, col, live, cos_seq_stride, cos_row_stride, ROPE_HALF)
    for head in range(heads):
        row = position * heads + head
        x = tl.load(x_ptr + position * x_stride + head * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
        grad = summed_copies(grad_ptr, row, copies, col, live, POSITIONS, HEAD_DIM)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        normed = x * inv_rms
        if has_gain:
            out = _rotated(normed, pair_partners(normed, POSITIONS, HEAD_DIM, ROPE_HALF), cos, sin, HEAD_DIM,
                           ROPE_HALF)
            tl.store(gain_rows_ptr + row, tl.sum(grad * out, axis=1)[:, None], mask=live)
            grad = grad * tl.load(gain_ptr + head)
        # the rotation's transpose: the rotation by the opposite angle
        grad_normed = _rotated(grad, pair_partners(grad, POSITIONS, HEAD_DIM, ROPE_HALF), cos, -sin, HEAD_DIM,
                               ROPE_HALF)
        # the norm's: (g - normed * mean(g * normed)) / rms
        dx = inv_rms * (grad_normed - normed * (tl.sum(grad_normed * normed, axis=1) / HEAD_DIM)[:, None])
        tl.store(dx_ptr + position * dx_stride + head * HEAD_DIM + col, dx, mask=live)


@triton.jit
def _rotated(x, partner, cos, sin, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr):
    """Rows of heads x rotated in float32, each channel's partner in its pair given:
    (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin) on the first 2 * ROPE_HALF channels, the
    others as they are."""
    col = tl.arange(0, HEAD_DIM)[None, :]
    rotated = tl.where(col < ROPE_HALF, x * cos + partner * sin, partner * -sin + x * cos)
    return tl.where(col < 2 * ROPE_HALF, rotated, x)


@triton.jit
def leaky_square_derivative(h, grad, negative_slope):
    """d/dh of leaky_relu(h)^2 times grad, in float32: 2 h where h > 0, else 2 slope^2 h."""
    slope = tl.where(h > 0, 1.0, negative_slope)
    return grad * 2.0 * h * slope * slope


@triton.jit
def _leaky_square_backward_kernel(h_ptr, grad_ptr, dh_ptr, numel, negative_slope, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(dh_ptr + offsets, leaky_square_derivative(h, grad, negative_slope), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _leaky_square_grad_matmul_kernel(g_desc, w_desc, h_desc, out_desc, rows, cols, depth, negative_slope,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                     PROGRAMS: tl.constexpr):
    """out = leaky_square'(h) * (g @ w) for g [rows, depth], w [depth, cols] and h, out
    [rows, cols] given by TMA descriptors (cols a multiple of BLOCK_N, depth of BLOCK_K):
    the product rounded to bf16, as a stored gradient is, then the derivative in float32.
    Persistent, as `elementwise._leaky_square_matmul_kernel`."""
    col_tiles = cols // BLOCK_N
    tiles = tl.cdiv(rows, BLOCK_M) * col_tiles
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        row0, col0, acc = product_tile(g_desc, w_desc, tile, col_tiles, depth, BLOCK_M, BLOCK_N, BLOCK_K, False)
        h = h_desc.load([row0, col0]).to(tl.float32)
        grad = acc.to(tl.bfloat16).to(tl.float32)
        out_desc.store([row0, col0], leaky_square_derivative(h, grad, negative_slope).to(tl.bfloat16))


# --- Launches ----------------------------------------------------------------------------

def head_prep_backward(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor, gain: Tensor | None,
                       launch: HeadLaunch = HEAD_LAUNCH, dx: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(the gradient with respect to x, and to gain if given) of `kernels.head_prep`, from
    the gradient of its result (of `copies` times x's heads: grad's heads say how many). dx:
    where to store x's gradient (x's shape, `evenly_spaced`), e.g. a slice of one gradient for
    several ops' heads; a new tensor if None."""
    b, t, heads, head_dim = x.shape
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype) if dx is None else dx
    if dx.shape != x.shape or not evenly_spaced(dx):
        raise ValueError(f"dx {tuple(dx.shape)}, strides {dx.stride()}: not x's shape with evenly spaced positions")
    gain_rows = torch.empty(b * t * heads, device=x.device, dtype=torch.float32) if gain is not None else cos
    x, x_stride = by_positions(x)
    _head_prep_backward_kernel[(triton.cdiv(b * t, launch.positions),)](
        grad.contiguous(), x, cos, sin, float32_values(gain, cos), dx, gain_rows, b * t, t, x_stride, dx.stride(1),
        *head_table_strides(cos), FLOAT32_EPS, heads, int(gain is not None), grad.size(2) // heads,
        HEAD_DIM=head_dim, ROPE_HALF=cos.size(-1), POSITIONS=launch.positions, num_warps=launch.warps)
    return dx, (gain_rows.view(-1, heads).sum(0) if gain is not None else None)


def leaky_square_backward(grad: Tensor, h: Tensor, negative_slope: float) -> Tensor:
    dh = torch.empty_like(h)
    _leaky_square_backward_kernel[(triton.cdiv(h.numel(), ELEMENTS),)](h, grad.contiguous(), dh, h.numel(),
                                                                       negative_slope, BLOCK=ELEMENTS)
    return dh


def leaky_square_grad_matmul(grad: Tensor, w: Tensor, h: Tensor, negative_slope: float,
                             tiles: MatmulTiles) -> Tensor:
    """The gradient at the MLP's product h [rows, cols] from the gradient at its output,
    grad [rows, depth], through the down projection w [depth, cols]: leaky_square'(h) *
    (grad @ w), bf16, in one kernel (cols a multiple of tiles.block_n, depth of block_k)."""
    grad, w, h = tma_ready(grad), tma_ready(w), tma_ready(h)
    rows, depth = grad.shape
    cols = w.size(1)
    out = torch.empty(rows, cols, device=grad.device, dtype=torch.bfloat16)
    programs = programs_for(grad.device)
    _leaky_square_grad_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(grad, [tiles.block_m, tiles.block_k]),
        TensorDescriptor.from_tensor(w, [tiles.block_k, tiles.block_n]),
        TensorDescriptor.from_tensor(h, [tiles.block_m, tiles.block_n]),
        TensorDescriptor.from_tensor(out, [tiles.block_m, tiles.block_n]), rows, cols, depth, negative_slope,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PROGRAMS=programs,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
