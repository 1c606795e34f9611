"""Sliding-window attention with sink tokens as Triton flash-attention kernels (forward and
backward), one custom op that runs eagerly and inside `torch.compile(fullgraph=True)`.

The rule is `attention.may_attend`'s: query i sees key j when j <= i and either
i - j <= window or j < sinks (window 0: the whole causal prefix). A program for a block of
queries visits only the key blocks it can see: the block(s) holding the sinks, then those
of [q_start - window, q_end]; the element mask is applied only on blocks that cut through
the rule's boundary. q is [B, T, H, D], k and v [B, T, Hkv, D] (GQA: query head h reads
kv head h // (H // Hkv)), read through their strides. Softmax in float32, through exp2.

Compared with FlexAttention this needs no compilation at the first call (each kernel is
built once per machine and dtype, a second or so), so eager callers (sliding evaluation,
test-time training) start at once.

The backward is the usual split: delta = rowsum(dO * O), then one program per key block
for dK and dV (summing over the kv head's query heads inside the program: deterministic,
no atomics) and one per query block for dQ.

The kernels' names hold "attention", so that profiles (bench/train_profile.py) count them as
such. Triton is imported here alone; `runtime.triton_available` says whether they can run.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass
from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = math.log2(math.e)
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_LN2: tl.constexpr = tl.constexpr(math.log(2.0))
# Running row maxima start finite, so that a block with no visible key for a row gives
# exp2(-inf - m) = 0 and never exp2(-inf - (-inf)) = NaN.
_MAX_START: tl.constexpr = tl.constexpr(-1.0e30)


@dataclass(frozen=True)
class Tuning:
    """Block sizes, warps and pipeline stages. The forward's programs own fwd_block_m queries
    and loop over keys fwd_block_n at a time. The dK/dV programs own bwd_block_own keys and
    loop over queries bwd_block_loop at a time (the delta kernel's programs own bwd_block_own
    rows); the dQ programs own dq_block_own queries and loop over keys dq_block_loop at a
    time. The defaults suit Hopper at head size 64 (bench/attention_speed.py --sweep); tests
    in the interpreter use tiny blocks."""

    fwd_block_m: int = 64
    fwd_block_n: int = 32
    fwd_warps: int = 4
    fwd_stages: int = 3
    bwd_block_own: int = 64
    bwd_block_loop: int = 32
    bwd_warps: int = 4
    bwd_stages: int = 3
    dq_block_own: int = 64
    dq_block_loop: int = 32
    dq_warps: int = 4
    dq_stages: int = 3

    def as_list(self) -> list[int]:
        return list(astuple(self))


DEFAULT_TUNING = Tuning()


# --- Kernels -----------------------------------------------------------------------------

@triton.jit
def _visible(rows, cols, seq_len, window, sinks):
    """may_attend for a block of rows (queries) against a block of cols (keys), and cols
    inside the sequence. Here window > 0: full causal attention comes as window = T."""
    return (cols <= rows) & (cols < seq_len) & (((rows - cols) <= window) | (cols < sinks))


@triton.jit
def _key_ranges(q_start, seq_len, window, sinks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks a block of queries [q_start, q_start + BLOCK_M) visits, as block-aligned
    starts: sink blocks [0, sink_end) that lie before the window's, then the window's blocks
    [lo, hi), of which [full_lo, full_hi) are visible to every row (no mask needed)."""
    hi = tl.minimum(q_start + BLOCK_M, seq_len)
    lo = (tl.maximum(q_start - window, 0) // BLOCK_N) * BLOCK_N
    sink_end = tl.minimum(tl.cdiv(sinks, BLOCK_N) * BLOCK_N, lo)
    # Every row sees a key block whole when the block's first key is within the window of
    # the last row, its last key is at or before the first row (causal), and it ends inside
    # the sequence.
    full_lo = tl.cdiv(tl.maximum(q_start + BLOCK_M - 1 - window, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.minimum((q_start + 1) // BLOCK_N, seq_len // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return sink_end, lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(k_start, seq_len, window, sinks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query blocks that see keys [k_start, k_start + BLOCK_N), as block-aligned starts
    [lo, hi), of which [full_lo, full_hi) see every key of the block. A block holding a sink
    is seen by every later query."""
    lo = (k_start // BLOCK_M) * BLOCK_M
    hi = tl.where(k_start < sinks, seq_len, tl.minimum(k_start + BLOCK_N + window, seq_len))
    # Every query of a block sees every key when its first query is at or after the last key
    # (causal), its last query is within the window of the first key, and it ends inside
    # the sequence, as do the keys.
    full_lo = tl.cdiv(k_start + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    full_lo = tl.where(k_start + BLOCK_N > seq_len, hi, full_lo)
    full_hi = tl.minimum((k_start + window + 1) // BLOCK_M, seq_len // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_block(k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, k_start, seq_len,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(positions, keys, values) of the BLOCK_N keys from k_start (zeros past the sequence)."""
    dims = tl.arange(0, HEAD_DIM)
    cols = k_start + tl.arange(0, BLOCK_N)
    in_seq = (cols < seq_len)[:, None]
    k = tl.load(k_base + cols[:, None] * stride_kt + dims[None, :] * stride_kd, mask=in_seq, other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vt + dims[None, :] * stride_vd, mask=in_seq, other=0.0)
    return cols, k, v


@triton.jit
def _forward_blocks(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows, start,
                    end, seq_len, window, sinks, qk_scale, MASKED: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Online softmax of a block of queries over key blocks [start, end)."""
    for k_start in range(start, end, BLOCK_N):
        cols, k, v = _key_block(k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, k_start, seq_len,
                                BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = tl.where(_visible(rows[:, None], cols[None, :], seq_len, window, sinks), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _row_tile(base, rows, dims, live, stride_t, stride_d):
    """The [rows, head_dim] tile of one head whose first element is at base; zeros where not live."""
    return tl.load(base + rows[:, None] * stride_t + dims[None, :] * stride_d, mask=live[:, None], other=0.0)


@triton.jit
def query_program(num_heads, group, BLOCK_M: tl.constexpr):
    """This program's block of queries: (first query, batch, head, kv head, query positions);
    the sink kernels (`attention_sinks`) take theirs from it too."""
    q_start = tl.program_id(0) * BLOCK_M
    batch = (tl.program_id(1) // num_heads).to(tl.int64)
    head = tl.program_id(1) % num_heads
    return q_start, batch, head, head // group, q_start + tl.arange(0, BLOCK_M)


@triton.jit
def _attention_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                              stride_qb, stride_qt, stride_qh, stride_qd,
                              stride_kb, stride_kt, stride_kh, stride_kd,
                              stride_vb, stride_vt, stride_vh, stride_vd,
                              stride_ob, stride_ot, stride_oh, stride_od,
                              seq_len, num_heads, group, window, sinks, qk_scale,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out and the natural log-sum-exp [B, H, T] of one block of queries of one head."""
    q_start, batch, head, kv_head, rows = query_program(num_heads, group, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_live = (rows < seq_len)[:, None]
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    q = _row_tile(q_base, rows, dims, rows < seq_len, stride_qt, stride_qd)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), _MAX_START, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sink_end, lo, full_lo, full_hi, hi = _key_ranges(q_start, seq_len, window, sinks, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                    rows, 0, sink_end, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                    rows, lo, full_lo, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                    rows, full_lo, full_hi, seq_len, window, sinks, qk_scale, False, BLOCK_N, HEAD_DIM)
    acc, m_i, l_i = _forward_blocks(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                    rows, full_hi, hi, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    out_base = out_ptr + batch * stride_ob + head * stride_oh
    tl.store(out_base + rows[:, None] * stride_ot + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_live)
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # back from base 2
    tl.store(lse_ptr + (batch * num_heads + head) * seq_len + rows, lse, mask=rows < seq_len)


@triton.jit
def _attention_delta_kernel(out_ptr, grad_ptr, delta_ptr,
                            stride_ob, stride_ot, stride_oh, stride_od,
                            stride_gb, stride_gt, stride_gh, stride_gd,
                            seq_len, num_heads, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """delta [B, H, T] = rowsum(dO * O) in float32, the softmax backward's correction."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch = (tl.program_id(1) // num_heads).to(tl.int64)
    head = tl.program_id(1) % num_heads
    dims = tl.arange(0, HEAD_DIM)
    live = rows < seq_len
    out = _row_tile(out_ptr + batch * stride_ob + head * stride_oh, rows, dims, live, stride_ot, stride_od)
    grad = _row_tile(grad_ptr + batch * stride_gb + head * stride_gh, rows, dims, live, stride_gt, stride_gd)
    delta = tl.sum(out.to(tl.float32) * grad.to(tl.float32), 1)
    tl.store(delta_ptr + (batch * num_heads + head) * seq_len + rows, delta, mask=live)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, stats_base, lse_ptr, delta_ptr, stride_qt, stride_qh, stride_qd,
                 stride_dot, stride_doh, stride_dod, seq_len, cols, start, end, group, window, sinks, qk_scale,
                 MASKED: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dK and dV of a block of keys from the query blocks [start, end) of each of the
    group's query heads, in transposed form (keys along rows). One flat loop over (head,
    block) pairs, so that the compiler pipelines its loads across heads too."""
    dims = tl.arange(0, HEAD_DIM)
    blocks = tl.cdiv(end - start, BLOCK_M)
    for step in range(0, group * blocks):
        member = step // blocks
        rows = start + (step - member * blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < seq_len
        q = _row_tile(q_base + member * stride_qh, rows, dims, live, stride_qt, stride_qd)
        do = _row_tile(do_base + member * stride_doh, rows, dims, live, stride_dot, stride_dod)
        stats = stats_base + member * seq_len + rows
        lse = tl.load(lse_ptr + stats, mask=live, other=0.0) * _LOG2E
        delta = tl.load(delta_ptr + stats, mask=live, other=0.0)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            visible = _visible(rows[None, :], cols[:, None], seq_len, window, sinks) & live[None, :]
            p_t = tl.where(visible, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attention_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                           stride_qb, stride_qt, stride_qh, stride_qd,
                           stride_kb, stride_kt, stride_kh, stride_kd,
                           stride_vb, stride_vt, stride_vh, stride_vd,
                           stride_dob, stride_dot, stride_doh, stride_dod,
                           seq_len, num_heads, num_kv_heads, group, window, sinks, qk_scale, sm_scale,
                           sink_programs, sink_span, other_blocks, sink_blocks,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dK and dV of one block of keys of one kv head: the sum over the kv head's query
    heads and over every query block that sees the keys. dk and dv are k's layout, contiguous.

    One program per (kv head of a sequence, key block), in launch order: first the
    sink_blocks first key blocks of every kv head (sink_programs programs: the blocks
    holding sink keys, which every later query sees, several times a window's work), so
    that none of them starts in the last wave; then each kv head's other_blocks key blocks
    in turn, neighbours together (they read mostly the same queries). sink_span and
    other_blocks are at least 1, so that neither division is by zero."""
    program = tl.program_id(0)
    rest = program - sink_programs
    column = tl.where(rest < 0, program // sink_span, rest // other_blocks)
    k_start = tl.where(rest < 0, program % sink_span, sink_blocks + rest % other_blocks) * BLOCK_N
    batch = (column // num_kv_heads).to(tl.int64)
    kv_head = column % num_kv_heads
    cols = k_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_live = (cols < seq_len)[:, None]
    k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + cols[:, None] * stride_kt
                + dims[None, :] * stride_kd, mask=col_live, other=0.0)
    v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vt
                + dims[None, :] * stride_vd, mask=col_live, other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_ranges(k_start, seq_len, window, sinks, BLOCK_M, BLOCK_N)
    first_head = kv_head * group
    q_base = q_ptr + batch * stride_qb + first_head * stride_qh
    do_base = do_ptr + batch * stride_dob + first_head * stride_doh
    stats = (batch * num_heads + first_head) * seq_len
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, stats, lse_ptr, delta_ptr, stride_qt, stride_qh, stride_qd,
                          stride_dot, stride_doh, stride_dod, seq_len, cols, lo, full_lo, group, window, sinks,
                          qk_scale, True, BLOCK_M, HEAD_DIM)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, stats, lse_ptr, delta_ptr, stride_qt, stride_qh, stride_qd,
                          stride_dot, stride_doh, stride_dod, seq_len, cols, full_lo, full_hi, group, window, sinks,
                          qk_scale, False, BLOCK_M, HEAD_DIM)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, stats, lse_ptr, delta_ptr, stride_qt, stride_qh, stride_qd,
                          stride_dot, stride_doh, stride_dod, seq_len, cols, full_hi, hi, group, window, sinks,
                          qk_scale, True, BLOCK_M, HEAD_DIM)
    offsets = (batch * seq_len * num_kv_heads + cols[:, None] * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
    tl.store(dk_ptr + offsets, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=col_live)
    tl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=col_live)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows,
               start, end, seq_len, window, sinks, qk_scale, MASKED: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ of a block of queries from the key blocks [start, end)."""
    for k_start in range(start, end, BLOCK_N):
        cols, k, v = _key_block(k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, k_start, seq_len,
                                BLOCK_N, HEAD_DIM)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows[:, None], cols[None, :], seq_len, window, sinks), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attention_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                         stride_qb, stride_qt, stride_qh, stride_qd,
                         stride_kb, stride_kt, stride_kh, stride_kd,
                         stride_vb, stride_vt, stride_vh, stride_vd,
                         stride_dob, stride_dot, stride_doh, stride_dod,
                         seq_len, num_heads, group, window, sinks, qk_scale, sm_scale,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dQ of one block of queries of one head, over the key blocks it sees (as the forward).
    dq is q's layout, contiguous."""
    q_start, batch, head, kv_head, rows = query_program(num_heads, group, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    live = rows < seq_len
    q = _row_tile(q_ptr + batch * stride_qb + head * stride_qh, rows, dims, live, stride_qt, stride_qd)
    do = _row_tile(do_ptr + batch * stride_dob + head * stride_doh, rows, dims, live, stride_dot, stride_dod)
    stats = (batch * num_heads + head) * seq_len + rows
    lse = tl.load(lse_ptr + stats, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + stats, mask=live, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    sink_end, lo, full_lo, full_hi, hi = _key_ranges(q_start, seq_len, window, sinks, BLOCK_M, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows,
                    0, sink_end, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows,
                    lo, full_lo, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows,
                    full_lo, full_hi, seq_len, window, sinks, qk_scale, False, BLOCK_N, HEAD_DIM)
    dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd, rows,
                    full_hi, hi, seq_len, window, sinks, qk_scale, True, BLOCK_N, HEAD_DIM)
    offsets = (batch * seq_len * num_heads + rows[:, None] * num_heads + head) * HEAD_DIM + dims[None, :]
    tl.store(dq_ptr + offsets, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=live[:, None])


# --- Launchers ---------------------------------------------------------------------------

def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2] != 0:
        raise ValueError(f"window attention needs q [B, T, H, D] and k, v [B, T, Hkv, D] with Hkv dividing H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"window attention needs a head dimension that is a power of two >= 16, not {d}")


def _kernel_window(window: int, seq_len: int) -> int:
    """The kernels' window: full causal attention (window 0) is a window of the whole sequence."""
    return window if window > 0 else seq_len


def _forward(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int, tuning: Tuning) -> tuple[Tensor, Tensor]:
    b, t, h, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, t), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(t, tuning.fwd_block_m), b * h)
    _attention_forward_kernel[grid](q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                                    t, h, h // k.shape[2], _kernel_window(window, t), sinks, d ** -0.5 * LOG2E,
                                    BLOCK_M=tuning.fwd_block_m, BLOCK_N=tuning.fwd_block_n, HEAD_DIM=d,
                                    num_warps=tuning.fwd_warps, num_stages=tuning.fwd_stages)
    return out, lse


def _backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window: int, sinks: int,
              tuning: Tuning) -> tuple[Tensor, Tensor, Tensor]:
    delta = _delta(out, grad, tuning)
    dk, dv = _key_grads(grad, q, k, v, lse, delta, window, sinks, tuning)
    return _query_grads(grad, q, k, v, lse, delta, window, sinks, tuning), dk, dv


def _delta(out: Tensor, grad: Tensor, tuning: Tuning) -> Tensor:
    b, t, h, d = out.shape
    delta = torch.empty((b, h, t), dtype=torch.float32, device=out.device)
    _attention_delta_kernel[(triton.cdiv(t, tuning.bwd_block_own), b * h)](
        out, grad, delta, *out.stride(), *grad.stride(), t, h, BLOCK_M=tuning.bwd_block_own, HEAD_DIM=d)
    return delta


def _gradient_arguments(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> tuple:
    """The gradient kernels' arguments after their tensors, in three parts: the strides of
    q, k, v and grad; (seq_len, num_heads); (group, window, sinks, and the scores' scale in
    base 2 and as is). The dK/dV kernel takes num_kv_heads between the last two."""
    scale = q.shape[3] ** -0.5
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad.stride())
    rule = (q.shape[2] // k.shape[2], _kernel_window(window, q.shape[1]), sinks, scale * LOG2E, scale)
    return strides, (q.shape[1], q.shape[2]), rule


def _key_grads(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, window: int, sinks: int,
               tuning: Tuning) -> tuple[Tensor, Tensor]:
    b, t, kv_heads, d = k.shape
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    strides, sizes, rule = _gradient_arguments(grad, q, k, v, window, sinks)
    key_blocks = triton.cdiv(t, tuning.bwd_block_own)
    sink_blocks = min(triton.cdiv(sinks, tuning.bwd_block_own), key_blocks)
    order = (b * kv_heads * sink_blocks, max(sink_blocks, 1), max(key_blocks - sink_blocks, 1), sink_blocks)
    _attention_dkdv_kernel[(b * kv_heads * key_blocks,)](
        q, k, v, grad, lse, delta, dk, dv, *strides, *sizes, kv_heads, *rule, *order,
        BLOCK_M=tuning.bwd_block_loop, BLOCK_N=tuning.bwd_block_own, HEAD_DIM=d, num_warps=tuning.bwd_warps,
        num_stages=tuning.bwd_stages)
    return dk, dv


def _query_grads(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, window: int, sinks: int,
                 tuning: Tuning) -> Tensor:
    b, t, h, d = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    strides, sizes, rule = _gradient_arguments(grad, q, k, v, window, sinks)
    _attention_dq_kernel[(triton.cdiv(t, tuning.dq_block_own), b * h)](
        q, k, v, grad, lse, delta, dq, *strides, *sizes, *rule, BLOCK_M=tuning.dq_block_own,
        BLOCK_N=tuning.dq_block_loop, HEAD_DIM=d, num_warps=tuning.dq_warps, num_stages=tuning.dq_stages)
    return dq


def kernel_builds(device: torch.device, *, heads: int, kv_heads: int, head_dim: int, seq_len: int, window: int,
                  sinks: int, backward: bool, dtype: torch.dtype = torch.bfloat16,
                  tuning: Tuning = DEFAULT_TUNING) -> list[Callable[[], object]]:
    """Launches on one sequence of zeros that build the kernels a call with these sizes
    runs (the forward; with backward, also the three gradient kernels), one per kernel, to
    run in parallel threads (`runtime.run_in_threads`): a build is seconds, mostly spent
    waiting on Triton's compiler processes, and a first call would run the builds one after
    another. The tensors keep the real ones' layouts, so the real calls find the kernels
    built (Triton specializes on strides' divisibility)."""
    def zeros(*shape: int, dtype: torch.dtype = dtype) -> Tensor:
        return torch.zeros(*shape, device=device, dtype=dtype)

    q, grad = zeros(1, seq_len, heads, head_dim), zeros(1, seq_len, heads, head_dim)
    k, v = zeros(1, seq_len, kv_heads, head_dim), zeros(1, seq_len, kv_heads, head_dim)
    stats = zeros(1, heads, seq_len, dtype=torch.float32)
    builds = [lambda: _forward(q, k, v, window, sinks, tuning)]
    if backward:
        builds += [lambda: _delta(q, grad, tuning),
                   lambda: _key_grads(grad, q, k, v, stats, stats, window, sinks, tuning),
                   lambda: _query_grads(grad, q, k, v, stats, stats, window, sinks, tuning)]
    return builds


# --- The custom op -----------------------------------------------------------------------
# An opaque op to torch.compile (its fake implementation gives the shapes), with its own
# backward op, so the compiled model keeps one graph. The tuning travels as a list of ints.

@torch.library.custom_op("windowgpt::window_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int,
                  tuning: list[int]) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, window, sinks, Tuning(*tuning))


@_attention_op.register_fake
def _attention_shapes(q, k, v, window, sinks, tuning):
    b, t, h, d = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("windowgpt::window_attention_backward", mutates_args=())
def _attention_backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window: int,
                           sinks: int, tuning: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(grad, q, k, v, out, lse, window, sinks, Tuning(*tuning))


@_attention_backward_op.register_fake
def _attention_backward_shapes(grad, q, k, v, out, lse, window, sinks, tuning):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, window, sinks, tuning = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window, ctx.sinks, ctx.tuning = window, sinks, tuning


def _attention_grads(ctx, grad, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(grad, q, k, v, out, lse, ctx.window, ctx.sinks, ctx.tuning)
    return dq, dk, dv, None, None, None


_attention_op.register_autograd(_attention_grads, setup_context=_save_for_backward)


def window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int,
                     tuning: Tuning = DEFAULT_TUNING) -> Tensor:
    """Causal attention with a sliding window and sink tokens (`attention.may_attend`'s rule),
    out [B, T, H, D] in q's dtype, differentiable in q, k and v."""
    _check_shapes(q, k, v)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and
                                                  (q.requires_grad or k.requires_grad or v.requires_grad)):
        # Nothing to trace or differentiate: launch the kernel directly. The op's dispatch
        # would import TorchDynamo at its first call, seconds of an evaluation's start.
        return _forward(q, k, v, window, sinks, tuning)[0]
    return _attention_op(q, k, v, window, sinks, tuning.as_list())[0]
