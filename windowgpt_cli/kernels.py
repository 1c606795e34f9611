"""Fused GPU kernels for the element-wise steps of an inference forward (Triton).

`FusedOps` runs `model.TorchOps`'s steps with one kernel each: every step reads its inputs
once and writes its outputs once, in float32 arithmetic rounded where the torch steps round
under bf16 autocast (the inputs of matrix products and of the attention). The matrix
products and the attention stay cuBLAS's and cuDNN's. These few small kernels build in
seconds where compiling the whole forward takes tens of seconds, and a batch runs within
about 10% of the compiled forward's time, so sliding evaluation scores with them on CUDA.

Inference only (no autograd). Triton is imported here alone; `runtime.fused_kernels_available`
says whether they can run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .model import Residual, TorchOps

FLOAT32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default epsilon for float32
NORMALIZE_EPS = 1e-12  # F.normalize's
# Rows per program: a program per row of a million-row batch would spend its time starting.
STREAM_ROWS = 8  # rows of the residual stream (model_dim wide)
HEAD_ROWS = 64  # rows of one head (head_dim wide)


# --- Kernels -----------------------------------------------------------------------------

@triton.jit
def _stream_norm_kernel(base_ptr, delta_ptr, delta_scale_ptr, skip_ptr, skip_weight_ptr, x0_ptr, mix_ptr,
                        factor_ptr, sum_ptr, out_ptr, normed_ptr, rows, width, eps,
                        HAS_DELTA: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_MIX: tl.constexpr,
                        STORE_SUM: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows of the residual stream: x = base + delta_scale * delta + skip_weight * skip
    (stored in sum_ptr with STORE_SUM); with HAS_MIX, out = mix[0] * x + mix[1] * x0, else
    out = x; normed = bf16(rms_norm(out) * factor)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < width)
    offsets = row * width + cols
    x = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        scale = tl.load(delta_scale_ptr + cols, mask=cols < width, other=0.0)
        x = x + scale * tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_SKIP:
        weight = tl.load(skip_weight_ptr + cols, mask=cols < width, other=0.0)
        x = x + weight * tl.load(skip_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if STORE_SUM:
        tl.store(sum_ptr + offsets, x, mask=mask)
    if HAS_MIX:
        mix_x = tl.load(mix_ptr + cols, mask=cols < width, other=0.0)
        mix_x0 = tl.load(mix_ptr + width + cols, mask=cols < width, other=0.0)
        x = mix_x * x + mix_x0 * tl.load(x0_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, x, mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
    factor = tl.load(factor_ptr)
    tl.store(normed_ptr + offsets, (x * inv_rms[:, None] * factor).to(tl.bfloat16), mask=mask)


@triton.jit
def _head_prep_kernel(x_ptr, cos_ptr, sin_ptr, gain_ptr, out_ptr, rows, rows_per_seq, cos_seq_stride,
                      cos_row_stride, eps, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr,
                      HAS_GAIN: tl.constexpr, ROWS: tl.constexpr):
    """ROWS heads (a row is one head at one position, HEADS rows per position, contiguous):
    each normed, its first 2 * ROPE_HALF channels rotated (pairs c, c + ROPE_HALF), times its
    gain; stored contiguous in bf16."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, HEAD_DIM)[None, :]
    live = row < rows
    position, head = row // HEADS, row % HEADS
    seq, pos = position // rows_per_seq, position % rows_per_seq
    in_first = col < ROPE_HALF
    rotated = col < 2 * ROPE_HALF
    partner = tl.where(in_first, col + ROPE_HALF, tl.where(rotated, col - ROPE_HALF, col))
    x = tl.load(x_ptr + row * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + row * HEAD_DIM + partner, mask=live, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    x, x_partner = x * inv_rms, x_partner * inv_rms
    table = seq * cos_seq_stride + pos * cos_row_stride + tl.where(in_first, col, col - ROPE_HALF)
    cos = tl.load(cos_ptr + table, mask=live & rotated, other=1.0)
    sin = tl.load(sin_ptr + table, mask=live & rotated, other=0.0)
    # (x1, x2) -> (x1 cos + x2 sin, x1 (-sin) + x2 cos), x1 the first channel of a pair
    out = tl.where(in_first, x * cos + x_partner * sin, tl.where(rotated, x_partner * (-sin) + x * cos, x))
    if HAS_GAIN:
        out = out * tl.load(gain_ptr + head, mask=live, other=0.0)
    tl.store(out_ptr + row * HEAD_DIM + col, out.to(tl.bfloat16), mask=live)


@triton.jit
def _exclude_self_value_kernel(y_ptr, v_ptr, out_ptr, rows, rows_per_seq, y_seq_stride, y_row_stride,
                               y_head_stride, v_seq_stride, v_row_stride, v_head_stride, eps,
                               HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                               ROWS: tl.constexpr):
    """XSA for ROWS heads (a row is one head at one position): each head's output minus its
    component along its group's normalized value; stored contiguous in bf16."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, HEAD_DIM)[None, :]
    live = row < rows
    position, head = row // HEADS, row % HEADS
    seq, pos = position // rows_per_seq, position % rows_per_seq
    y = tl.load(y_ptr + seq * y_seq_stride + pos * y_row_stride + head * y_head_stride + col, mask=live, other=0.0)
    v = tl.load(v_ptr + seq * v_seq_stride + pos * v_row_stride + (head // GROUP) * v_head_stride + col,
                mask=live, other=0.0)
    y, v = y.to(tl.float32), v.to(tl.float32)
    v_unit = v / tl.maximum(tl.sqrt(tl.sum(v * v, axis=1)), eps)[:, None]
    projection = tl.sum(y * v_unit, axis=1)[:, None] * v_unit
    tl.store(out_ptr + row * HEAD_DIM + col, (y - projection).to(tl.bfloat16), mask=live)


@triton.jit
def _leaky_square_kernel(h_ptr, out_ptr, numel, negative_slope, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    h = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    leaky = tl.where(h > 0, h, h * negative_slope)
    leaky = leaky.to(h_ptr.dtype.element_ty).to(tl.float32)  # leaky_relu's output has h's dtype
    tl.store(out_ptr + offsets, (leaky * leaky).to(out_ptr.dtype.element_ty), mask=mask)


# --- The steps ---------------------------------------------------------------------------

class FusedOps(TorchOps):
    """`TorchOps` with its per-layer steps as fused kernels (CUDA, inference, bf16 autocast).

    Outputs that feed a matrix product or the attention are bf16, as autocast would cast
    them there; the residual stream stays float32. The stream's sum on its own (once per
    forward) and the soft cap keep torch's code."""

    def block_input(self, stream: Residual, x0: Tensor, mix: Tensor, factor: Tensor,
                    keep_sum: bool) -> tuple[Tensor | None, Tensor, Tensor]:
        kept = torch.empty_like(stream.base, dtype=torch.float32) if keep_sum else None
        x_in, normed = _stream_norm(stream, factor, x0=x0, mix=mix, kept=kept)
        return kept, x_in, normed

    def residual_norm(self, stream: Residual, factor: Tensor) -> tuple[Tensor, Tensor]:
        return _stream_norm(stream, factor)

    def final_norm(self, stream: Residual) -> Tensor:
        return _stream_norm(stream, torch.ones((), device=stream.base.device))[1]

    def head_prep(self, x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None) -> Tensor:
        b, t, heads, head_dim = x.shape
        if not _powers_of_two(heads, head_dim):
            return super().head_prep(x, cos, sin, rope_dims, gain)
        x = x.contiguous()
        rope_half = (rope_dims if 0 < rope_dims < head_dim else head_dim) // 2
        cos, sin = (table.expand(b if table.size(0) > 1 else 1, t, 1, rope_half).float().contiguous()
                    for table in (cos, sin))
        out = torch.empty(b, t, heads, head_dim, device=x.device, dtype=torch.bfloat16)
        rows = b * t * heads
        _head_prep_kernel[(triton.cdiv(rows, HEAD_ROWS),)](
            x, cos, sin, gain if gain is not None else cos, out, rows, t, cos.stride(0) if cos.size(0) > 1 else 0,
            cos.stride(1), FLOAT32_EPS, HEADS=heads, HEAD_DIM=head_dim, ROPE_HALF=rope_half,
            HAS_GAIN=gain is not None, ROWS=HEAD_ROWS)
        return out

    def exclude_self_value(self, y: Tensor, v: Tensor) -> Tensor:
        b, t, heads, head_dim = y.shape
        if not _powers_of_two(heads, head_dim) or y.stride(-1) != 1 or v.stride(-1) != 1:
            return super().exclude_self_value(y, v)
        out = torch.empty(b, t, heads, head_dim, device=y.device, dtype=torch.bfloat16)
        rows = b * t * heads
        _exclude_self_value_kernel[(triton.cdiv(rows, HEAD_ROWS),)](
            y, v, out, rows, t, y.stride(0), y.stride(1), y.stride(2), v.stride(0), v.stride(1), v.stride(2),
            NORMALIZE_EPS, HEADS=heads, GROUP=heads // v.size(2), HEAD_DIM=head_dim, ROWS=HEAD_ROWS)
        return out

    def leaky_square(self, h: Tensor, negative_slope: float) -> Tensor:
        h = h.contiguous()
        out = torch.empty_like(h, dtype=torch.bfloat16)
        block = 4096
        _leaky_square_kernel[(triton.cdiv(h.numel(), block),)](h, out, h.numel(), negative_slope, BLOCK=block)
        return out

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        return (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)


def _stream_norm(stream: Residual, factor: Tensor, *, x0: Tensor | None = None, mix: Tensor | None = None,
                 kept: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, normed) of `_stream_norm_kernel` over every row of the stream."""
    base = stream.base.contiguous()
    width = base.size(-1)
    out = torch.empty_like(base, dtype=torch.float32)
    normed = torch.empty_like(base, dtype=torch.bfloat16)
    delta = stream.delta.contiguous() if stream.delta is not None else base
    skip = stream.skip.contiguous() if stream.skip is not None else base
    rows = base.numel() // width
    _stream_norm_kernel[(triton.cdiv(rows, STREAM_ROWS),)](
        base, delta, _float32(stream.delta_scale, base), skip, _float32(stream.skip_weight, base),
        x0.contiguous() if x0 is not None else base, _float32(mix, base), factor.float(),
        kept if kept is not None else out, out, normed, rows, width, FLOAT32_EPS,
        HAS_DELTA=stream.delta is not None, HAS_SKIP=stream.skip is not None, HAS_MIX=mix is not None,
        STORE_SUM=kept is not None, ROWS=STREAM_ROWS, BLOCK=triton.next_power_of_2(width), num_warps=8)
    return out, normed


def _powers_of_two(*sizes: int) -> bool:
    """Tiles of these sizes (heads, head dimension) fit a kernel's block shape exactly."""
    return all(n > 0 and n & (n - 1) == 0 for n in sizes)


def _float32(t: Tensor | None, placeholder: Tensor) -> Tensor:
    """A parameter as float32 values (or any tensor where the kernel reads nothing)."""
    return t.detach().float().contiguous() if t is not None else placeholder
