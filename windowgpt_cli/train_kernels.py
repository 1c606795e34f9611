"""Fused GPU kernels that autograd differentiates, for eager training steps (Triton).

Test-time training runs its steps eagerly: compiling a backward graph costs more than the
few hundred small steps it would speed up. Eagerly, torch runs each element-wise step as
several kernels, and autograd as several more, so those kernels, not the matrix products,
fill most of a step. `TrainingOps` runs the costliest steps as one kernel forward and one
backward: the per-head norm, rotation and gain of queries and keys (`_head_prep_backward_kernel`
after `kernels._head_prep_kernel`), and the MLP's LeakyReLU².

Forwards round as `kernels.FusedOps` does (float32 arithmetic, rounded where a tensor is
stored); backwards compute in float32 from the stored inputs and round once, to the
input's dtype. Importing this module imports Triton.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kernels import (ELEMENTS, FLOAT32_EPS, HEAD_POSITIONS, HEAD_WARPS, float32_values, head_positions, head_prep,
                      head_table_strides, head_tables, leaky_square, pair_partners, powers_of_two, rotary_at,
                      rotated_half)
from .model import GPT, TorchOps


# --- Kernels -----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["positions", "heads", "has_gain", "rows_per_seq"])
def _head_prep_backward_kernel(grad_ptr, x_ptr, cos_ptr, sin_ptr, gain_ptr, dx_ptr, gain_rows_ptr, positions,
                               rows_per_seq, cos_seq_stride, cos_row_stride, eps, heads, has_gain,
                               HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr, POSITIONS: tl.constexpr):
    """The gradient of `_head_prep_kernel` for every head at POSITIONS positions: with
    respect to x (stored in dx's dtype) and, if has_gain, each row's (head's at a position)
    share of its head's gain gradient (float32)."""
    position, col, live, seq, pos = head_positions(positions, rows_per_seq, HEAD_DIM, POSITIONS)
    cos, sin = rotary_at(cos_ptr, sin_ptr, seq, pos, col, live, cos_seq_stride, cos_row_stride, ROPE_HALF)
    for head in range(heads):
        row = position * heads + head
        offsets = row * HEAD_DIM + col
        x = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=live, other=0.0).to(tl.float32)
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
        tl.store(dx_ptr + offsets, dx, mask=live)


@triton.jit
def _rotated(x, partner, cos, sin, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr):
    """Rows of heads x rotated in float32, each channel's partner in its pair given:
    (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin) on the first 2 * ROPE_HALF channels, the
    others as they are."""
    col = tl.arange(0, HEAD_DIM)[None, :]
    rotated = tl.where(col < ROPE_HALF, x * cos + partner * sin, partner * -sin + x * cos)
    return tl.where(col < 2 * ROPE_HALF, rotated, x)


@triton.jit
def _leaky_square_backward_kernel(h_ptr, grad_ptr, dh_ptr, numel, negative_slope, BLOCK: tl.constexpr):
    """d/dh of leaky_relu(h)^2 times grad: 2 h where h > 0, else 2 slope^2 h."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    slope = tl.where(h > 0, 1.0, negative_slope)
    tl.store(dh_ptr + offsets, grad * 2.0 * h * slope * slope, mask=mask)


# --- Launches ----------------------------------------------------------------------------

def head_prep_backward(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor,
                       gain: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(the gradient with respect to x, and to gain if given) of `kernels.head_prep`."""
    b, t, heads, head_dim = x.shape
    dx = torch.empty_like(x)
    gain_rows = torch.empty(b * t * heads, device=x.device, dtype=torch.float32) if gain is not None else cos
    _head_prep_backward_kernel[(triton.cdiv(b * t, HEAD_POSITIONS),)](
        grad.contiguous(), x, cos, sin, float32_values(gain, cos), dx, gain_rows, b * t, t, *head_table_strides(cos),
        FLOAT32_EPS, heads, int(gain is not None), HEAD_DIM=head_dim, ROPE_HALF=cos.size(-1),
        POSITIONS=HEAD_POSITIONS, num_warps=HEAD_WARPS)
    return dx, (gain_rows.view(-1, heads).sum(0) if gain is not None else None)


def leaky_square_backward(grad: Tensor, h: Tensor, negative_slope: float) -> Tensor:
    dh = torch.empty_like(h)
    _leaky_square_backward_kernel[(triton.cdiv(h.numel(), ELEMENTS),)](h, grad.contiguous(), dh, h.numel(),
                                                                       negative_slope, BLOCK=ELEMENTS)
    return dh


class _HeadPrep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, gain: Tensor | None) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, cos, sin, gain)
        return head_prep(x, cos, sin, gain, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, cos, sin, gain = ctx.saved_tensors
        dx, dgain = head_prep_backward(grad, x, cos, sin, gain)
        return dx, None, None, dgain


class _LeakySquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, negative_slope: float) -> Tensor:
        h = h.contiguous()
        ctx.save_for_backward(h)
        ctx.negative_slope = negative_slope
        return leaky_square(h, negative_slope, h.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (h,) = ctx.saved_tensors
        return leaky_square_backward(grad, h, ctx.negative_slope), None


class TrainingOps(TorchOps):
    """`TorchOps` whose costliest element-wise steps in an eager training step are fused
    kernels, forward and backward (see the module's docstring); the rest is torch's."""

    def head_prep(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None) -> Tensor:
        tables = head_tables(x, cos, sin, rope_dims)
        if tables is None:
            return super().head_prep(x, cos, sin, rope_dims, gain)
        return _HeadPrep.apply(x, *tables, gain)

    def leaky_square(self, h: Tensor, negative_slope: float) -> Tensor:
        return _LeakySquare.apply(h, negative_slope)

    def kernel_builds(self, model: GPT, seq_len: int) -> list[Callable[[], object]]:
        """Launches on one sequence of zeros that build this class's kernels, forward and
        backward, for steps over sequences of seq_len (to run in parallel threads,
        `runtime.run_in_threads`). The arguments keep the real ones' dtypes and layouts."""
        cfg = model.cfg
        device = model.tok_emb.weight.device
        zeros = functools.partial(torch.zeros, device=device, dtype=torch.bfloat16)
        rope_half = rotated_half(cfg.head_dim, cfg.rope_dims)
        table = torch.zeros(1, seq_len, 1, rope_half, device=device)
        q, gain = zeros(1, seq_len, cfg.num_heads, cfg.head_dim), torch.zeros(cfg.num_heads, device=device)
        hidden = zeros(1, seq_len, cfg.mlp_dim)
        builds: list[Callable[[], object]] = [
            lambda: leaky_square(hidden, cfg.negative_slope, hidden.dtype),
            lambda: leaky_square_backward(hidden, hidden, cfg.negative_slope),
        ]
        if powers_of_two(cfg.head_dim, rope_half):
            builds += [lambda: head_prep(q, table, table, gain, q.dtype),
                       lambda: head_prep_backward(q, q, table, table, gain)]
        return builds
