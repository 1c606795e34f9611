"""XSA and the sparse output gate over the attention's output as one differentiable op
(`fused_attention_output`): each head's output minus its component along its group's
normalized value, times the head's gate, in one Triton kernel forward and one backward,
each reading the heads and their values once. Left to the compiler, the same steps take two
passes forward (the projection's dot products, then the subtraction and the gate) and
several back (the value's normalization among them), on tensors as large as the residual
stream.

A custom op, opaque to torch.compile (its fake implementation gives the shapes), with its own
backward op, so a compiled step keeps one graph. Importing this module imports Triton.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .elementwise import NORMALIZE_EPS, powers_of_two

ROWS, WARPS = 16, 4  # (position, value head) rows per program, warps per program


@triton.jit
def _group_rows(rows, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's ROWS rows ([ROWS, 1]: one value head at one position each), a head's
    channels ([1, HEAD_DIM]) and which rows are live."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    return row, tl.arange(0, HEAD_DIM)[None, :], row < rows


@triton.jit
def _unit(v, eps):
    """(v / max(|v|, eps), max(|v|, eps)) per row, as F.normalize computes it."""
    norm = tl.maximum(tl.sqrt_rn(tl.sum(v * v, axis=1)), eps)[:, None]
    return v / norm, norm


@triton.jit(do_not_specialize=["rows"])
def _xsa_forward_kernel(y_ptr, v_ptr, gate_ptr, out_ptr, rows, eps, HAS_GATE: tl.constexpr, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """For each row's GROUP query heads: the head minus its component along the row's unit
    value, times the head's gate if HAS_GATE; y and out [positions, heads, D] with heads =
    value heads * GROUP, v [positions, value heads, D], gate [positions, heads]."""
    row, col, live = _group_rows(rows, ROWS, HEAD_DIM)
    v_unit, _ = _unit(tl.load(v_ptr + row * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32), eps)
    for member in tl.static_range(GROUP):
        head = row * GROUP + member
        y = tl.load(y_ptr + head * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
        out = y - tl.sum(y * v_unit, axis=1)[:, None] * v_unit
        if HAS_GATE:
            out = out * tl.load(gate_ptr + head, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + head * HEAD_DIM + col, out, mask=live)


@triton.jit(do_not_specialize=["rows"])
def _xsa_backward_kernel(grad_ptr, y_ptr, v_ptr, gate_ptr, dy_ptr, dv_ptr, dgate_ptr, rows, eps,
                         HAS_GATE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """The gradients of `_xsa_forward_kernel` with respect to y, v (its group's heads summed)
    and the gate, from the output's gradient, in float32, each stored once in its tensor's
    dtype. With u the unit value and z = y - (y.u) u: dy = P(g gate) for the projection
    P = 1 - u u^T, du = -((y.u) g gate + (g gate.u) y), dv = P du / max(|v|, eps) (du / eps
    where |v| is below eps), dgate = g.z."""
    row, col, live = _group_rows(rows, ROWS, HEAD_DIM)
    v = tl.load(v_ptr + row * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
    v_unit, norm = _unit(v, eps)
    d_unit = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
    for member in tl.static_range(GROUP):
        head = row * GROUP + member
        y = tl.load(y_ptr + head * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + head * HEAD_DIM + col, mask=live, other=0.0).to(tl.float32)
        y_along = tl.sum(y * v_unit, axis=1)[:, None]
        if HAS_GATE:
            tl.store(dgate_ptr + head, tl.sum(grad * (y - y_along * v_unit), axis=1)[:, None], mask=live)
            grad = grad * tl.load(gate_ptr + head, mask=live, other=0.0).to(tl.float32)
        grad_along = tl.sum(grad * v_unit, axis=1)[:, None]
        tl.store(dy_ptr + head * HEAD_DIM + col, grad - grad_along * v_unit, mask=live)
        d_unit -= y_along * grad + grad_along * y
    projected = d_unit - tl.sum(d_unit * v_unit, axis=1)[:, None] * v_unit
    tl.store(dv_ptr + row * HEAD_DIM + col, tl.where(norm > eps, projected, d_unit) / norm, mask=live)


def _launch_grid(v: Tensor) -> tuple[int]:
    return (triton.cdiv(v.numel() // v.size(-1), ROWS),)


@torch.library.custom_op("windowgpt::xsa_gate", mutates_args=())
def _xsa_gate_op(y: Tensor, v: Tensor, gate: Optional[Tensor]) -> Tensor:
    out = torch.empty_like(y)
    _xsa_forward_kernel[_launch_grid(v)](
        y, v, gate if gate is not None else y, out, v.numel() // v.size(-1), NORMALIZE_EPS, HAS_GATE=gate is not None,
        GROUP=y.size(-2) // v.size(-2), HEAD_DIM=y.size(-1), ROWS=ROWS, num_warps=WARPS)
    return out


@_xsa_gate_op.register_fake
def _xsa_gate_shape(y, v, gate):
    return torch.empty_like(y)


@torch.library.custom_op("windowgpt::xsa_gate_backward", mutates_args=())
def _xsa_gate_backward_op(grad: Tensor, y: Tensor, v: Tensor, gate: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    dy, dv = torch.empty_like(y), torch.empty_like(v)
    dgate = torch.empty_like(gate) if gate is not None else y.new_empty(0)  # an op returns tensors, never None
    _xsa_backward_kernel[_launch_grid(v)](
        grad.contiguous(), y, v, gate if gate is not None else y, dy, dv, dgate, v.numel() // v.size(-1),
        NORMALIZE_EPS, HAS_GATE=gate is not None, GROUP=y.size(-2) // v.size(-2), HEAD_DIM=y.size(-1), ROWS=ROWS,
        num_warps=WARPS)
    return dy, dv, dgate


@_xsa_gate_backward_op.register_fake
def _xsa_gate_backward_shapes(grad, y, v, gate):
    return torch.empty_like(y), torch.empty_like(v), (torch.empty_like(gate) if gate is not None else y.new_empty(0))


def _save_for_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _xsa_gate_grads(ctx, grad):
    y, v, gate = ctx.saved_tensors
    dy, dv, dgate = _xsa_gate_backward_op(grad, y, v, gate)
    return dy, dv, (dgate if gate is not None else None)


_xsa_gate_op.register_autograd(_xsa_gate_grads, setup_context=_save_for_backward)


def fused_attention_output(y: Tensor, v: Tensor, gate: Tensor | None) -> Tensor | None:
    """`model.ops.TorchOps.attention_output` with XSA as the fused op: y [B, T, H, D], values
    v [B, T, Hkv, D], gate [B, T, H] or None; in y's dtype, differentiable in all three. None
    where the kernels cannot take them (a head not a power of two, heads that are not whole
    groups of the value heads): the caller runs torch's steps."""
    heads, value_heads = y.size(-2), v.size(-2)
    if not powers_of_two(y.size(-1)) or heads % value_heads or y.shape[:-2] != v.shape[:-2]:
        return None
    return _xsa_gate_op(y.contiguous(), v.contiguous(), gate.contiguous() if gate is not None else None)
