"""Sink tokens beside a window attention kernel that has none (FlashAttention-4's), as two
Triton kernels over the rows that see a sink outside their window.

Query i sees sink j outside its window when j < sinks and i - j > window; the window pass
saw every other key. The forward merges the sinks' softmax into the window pass's output and
log-sum-exp in place: out = (e^lse_w * out_w + sum_j e^s_j v_j) / (e^lse_w + sum_j e^s_j),
lse = log of that denominator. The backward rests on one identity: a flash-attention
backward handed the merged output and log-sum-exp instead of its own computes the exact
gradients over the window's keys (its probabilities exp(s - lse) are then the merged
softmax's, its correction rowsum(dO * O) the merged output's), so the window pass's own
backward needs no log-sum-exp gradient, and these kernels add only the sinks' share: to dQ
in place, and to dK and dV of the sink keys through per-block partial sums (added in a fixed
order: no atomics, the same result every run).

q, the output and its gradient are [B, T, H, D], k and v [B, T, Hkv, D] (GQA: query head h
reads kv head h // (H // Hkv)), the log-sum-exp [B, H, T], all read through their strides.
The kernels' names hold "attention", so that profiles count them as such.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .window_attention import query_program

BLOCK_M = 64  # query rows a program owns; the work is memory-bound, one pass over them


@triton.jit
def _sink_tiles(q_ptr, k_ptr, v_ptr, stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh,
                stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, seq_len, num_heads, group, window, sinks,
                scale, BLOCK_M: tl.constexpr, SINKS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's rows (the first is window + 1, the first to see sink 0 outside its
    window), their queries, the sinks' keys and values, and the rows' scores against the
    sinks (-inf where a sink is in the window, or past `sinks`)."""
    _, batch, head, kv_head, offsets = query_program(num_heads, group, BLOCK_M)  # offsets: this block's rows
    rows = window + 1 + offsets
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, SINKS_PAD)
    live = rows < seq_len
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qt + dims[None, :] * stride_qd,
                mask=live[:, None], other=0.0)
    is_sink = (cols < sinks)[:, None]
    k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + cols[:, None] * stride_kt
                + dims[None, :] * stride_kd, mask=is_sink, other=0.0)
    v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vt
                + dims[None, :] * stride_vd, mask=is_sink, other=0.0)
    outside = live[:, None] & (cols[None, :] < sinks) & (cols[None, :] < rows[:, None] - window)
    scores = tl.where(outside, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    return rows, batch, head, live, q, k, v, scores


@triton.jit
def _attention_sinks_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                                    stride_qb, stride_qt, stride_qh, stride_qd,
                                    stride_kb, stride_kt, stride_kh, stride_kd,
                                    stride_vb, stride_vt, stride_vh, stride_vd,
                                    stride_ob, stride_ot, stride_oh, stride_od,
                                    stride_lb, stride_lh, stride_lt,
                                    seq_len, num_heads, group, window, sinks, scale,
                                    BLOCK_M: tl.constexpr, SINKS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The window's output and log-sum-exp of one block of rows of one head, merged with the
    sinks outside the window, in place."""
    rows, batch, head, live, q, k, v, scores = _sink_tiles(
        q_ptr, k_ptr, v_ptr, stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, seq_len, num_heads, group, window, sinks, scale,
        BLOCK_M, SINKS_PAD, HEAD_DIM)
    lse_at = lse_ptr + batch * stride_lb + head * stride_lh + rows * stride_lt
    lse_window = tl.load(lse_at, mask=live, other=0.0)
    top = tl.maximum(lse_window, tl.max(scores, 1))
    window_weight = tl.exp(lse_window - top)
    p = tl.exp(scores - top[:, None])  # 0 where -inf
    total = window_weight + tl.sum(p, 1)
    dims = tl.arange(0, HEAD_DIM)
    out_at = out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot + dims[None, :] * stride_od
    out = tl.load(out_at, mask=live[:, None], other=0.0).to(tl.float32)
    out = (out * window_weight[:, None] + tl.dot(p.to(v.dtype), v)) / total[:, None]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(lse_at, top + tl.log(total), mask=live)


@triton.jit
def _attention_sinks_backward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, grad_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                                     stride_qb, stride_qt, stride_qh, stride_qd,
                                     stride_kb, stride_kt, stride_kh, stride_kd,
                                     stride_vb, stride_vt, stride_vh, stride_vd,
                                     stride_ob, stride_ot, stride_oh, stride_od,
                                     stride_gb, stride_gt, stride_gh, stride_gd,
                                     stride_lb, stride_lh, stride_lt,
                                     stride_dqb, stride_dqt, stride_dqh, stride_dqd,
                                     seq_len, num_heads, group, window, sinks, scale,
                                     BLOCK_M: tl.constexpr, SINKS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The sinks' share of the gradients of one block of rows of one head: added to dq in
    place; dk and dv [B, H, blocks, sinks, D] float32 get this block's partial sums."""
    rows, batch, head, live, q, k, v, scores = _sink_tiles(
        q_ptr, k_ptr, v_ptr, stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd, seq_len, num_heads, group, window, sinks, scale,
        BLOCK_M, SINKS_PAD, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    out = tl.load(out_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot
                  + dims[None, :] * stride_od, mask=live[:, None], other=0.0)
    grad = tl.load(grad_ptr + batch * stride_gb + head * stride_gh + rows[:, None] * stride_gt
                   + dims[None, :] * stride_gd, mask=live[:, None], other=0.0)
    delta = tl.sum(out.to(tl.float32) * grad.to(tl.float32), 1)
    lse = tl.load(lse_ptr + batch * stride_lb + head * stride_lh + rows * stride_lt, mask=live, other=0.0)
    p = tl.exp(scores - lse[:, None])  # the merged softmax's probabilities of the sinks
    dscores = p * (tl.dot(grad, tl.trans(v)) - delta[:, None])
    dq_at = dq_ptr + batch * stride_dqb + head * stride_dqh + rows[:, None] * stride_dqt + dims[None, :] * stride_dqd
    dq = tl.load(dq_at, mask=live[:, None], other=0.0).to(tl.float32)
    dq += tl.dot(dscores.to(k.dtype), k) * scale
    tl.store(dq_at, dq.to(dq_ptr.dtype.element_ty), mask=live[:, None])
    cols = tl.arange(0, SINKS_PAD)
    part = ((tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * sinks
            + cols[:, None]) * HEAD_DIM + dims[None, :]
    is_sink = (cols < sinks)[:, None]
    tl.store(dk_ptr + part, tl.dot(tl.trans(dscores).to(q.dtype), q) * scale, mask=is_sink)
    tl.store(dv_ptr + part, tl.dot(tl.trans(p).to(grad.dtype), grad), mask=is_sink)


def _grid(q: Tensor, window: int) -> tuple[int, int]:
    b, t, h, _ = q.shape
    return triton.cdiv(max(t - window - 1, 0), BLOCK_M), b * h


def _sizes(q: Tensor, k: Tensor, window: int, sinks: int) -> tuple:
    b, t, h, d = q.shape
    return t, h, h // k.shape[2], window, sinks, d ** -0.5


def _pad(sinks: int) -> int:
    return max(16, triton.next_power_of_2(sinks))  # tl.dot's smallest side


def merge_sinks_(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window: int, sinks: int) -> None:
    """out [B, T, H, D] and lse [B, H, T] of attention within the window (query i sees keys
    i - window .. i), made in place those of attention that also sees the first `sinks` keys."""
    grid = _grid(q, window)
    if sinks <= 0 or grid[0] == 0:
        return
    _attention_sinks_forward_kernel[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                                          *lse.stride(), *_sizes(q, k, window, sinks), BLOCK_M=BLOCK_M,
                                          SINKS_PAD=_pad(sinks), HEAD_DIM=q.shape[3])


def add_sink_grads_(dq: Tensor, dk: Tensor, dv: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad: Tensor,
                    lse: Tensor, window: int, sinks: int) -> None:
    """The sinks' share of the gradients, added in place to dq, dk and dv, those of the
    window's keys, which a flash backward computed from the merged out and lse."""
    grid = _grid(q, window)
    if sinks <= 0 or grid[0] == 0:
        return
    b, t, h, d = q.shape
    dk_part = torch.empty((b, h, grid[0], sinks, d), dtype=torch.float32, device=q.device)
    dv_part = torch.empty_like(dk_part)
    _attention_sinks_backward_kernel[grid](q, k, v, out, grad, lse, dq, dk_part, dv_part, *q.stride(), *k.stride(),
                                           *v.stride(), *out.stride(), *grad.stride(), *lse.stride(), *dq.stride(),
                                           *_sizes(q, k, window, sinks), BLOCK_M=BLOCK_M, SINKS_PAD=_pad(sinks),
                                           HEAD_DIM=d)
    kv_heads = k.shape[2]
    for total, part in ((dk, dk_part), (dv, dv_part)):  # over row blocks, then the group's heads
        share = part.sum(2).unflatten(1, (kv_heads, h // kv_heads)).sum(2)  # [B, Hkv, sinks, D]
        total[:, :sinks] += share.transpose(1, 2).to(total.dtype)
