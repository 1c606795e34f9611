"""Each query or key head's RMSNorm, partial rotation and gain as one differentiable op
(`fused_head_prep`): one Triton kernel forward (`elementwise._head_prep_kernel`) and one
backward (`elementwise_backward._head_prep_backward_kernel`), each reading the heads once.
Left to the compiler, the same steps take four passes over the queries forward (the norm's
statistics, the rotated channels, the concatenation with the others, the gain) and three
back, on a tensor as large as the residual stream. For attention handed keys of as many
heads as queries, the forward stores each key head once per query head of its group and the
backward adds up their gradients, with no pass of their own.

`fused_head_prep_pair` takes the queries and the keys of one stacked product's slice (their
heads side by side) as one op whose backward stores both gradients in one tensor, the slice's
gradient: so the product back takes them as one operand, and nothing copies them together.

Each a custom op, opaque to torch.compile (its fake implementation gives the shapes), with its
own backward op, so a compiled step keeps one graph; eager test-time training runs the same op.
Importing this module imports Triton.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .elementwise import HeadLaunch, head_prep, head_tables
from .elementwise_backward import head_prep_backward


def _launch(rotated_apart: bool) -> HeadLaunch:
    return HeadLaunch(rotated_apart=rotated_apart)


@torch.library.custom_op("windowgpt::head_prep", mutates_args=())
def _head_prep_op(x: Tensor, cos: Tensor, sin: Tensor, gain: Optional[Tensor], copies: int,
                  rotated_apart: bool) -> Tensor:
    return head_prep(x, cos, sin, gain, x.dtype, _launch(rotated_apart), copies=copies)


@_head_prep_op.register_fake
def _head_prep_shape(x, cos, sin, gain, copies, rotated_apart):
    b, t, heads, head_dim = x.shape
    return x.new_empty(b, t, heads * copies, head_dim)


@torch.library.custom_op("windowgpt::head_prep_backward", mutates_args=())
def _head_prep_backward_op(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor,
                           gain: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    dx, dgain = head_prep_backward(grad, x, cos, sin, gain)
    return dx, (dgain if dgain is not None else cos.new_empty(0))  # an op returns tensors, never None


@_head_prep_backward_op.register_fake
def _head_prep_backward_shapes(grad, x, cos, sin, gain):
    return x.new_empty(x.shape), (gain.new_empty(gain.shape) if gain is not None else cos.new_empty(0))


def _save_for_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4])


def _head_prep_grads(ctx, grad):
    x, cos, sin, gain = ctx.saved_tensors
    dx, dgain = _head_prep_backward_op(grad, x, cos, sin, gain)
    return dx, None, None, (dgain if gain is not None else None), None, None


_head_prep_op.register_autograd(_head_prep_grads, setup_context=_save_for_backward)


def fused_head_prep(x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None,
                    copies: int = 1, rotated_apart: bool = False) -> Tensor | None:
    """`model.ops.TorchOps.head_prep` of queries or keys x [B, T, H, D] as the fused op, in
    x's dtype, [B, T, H * copies, D], differentiable in x and gain; None where the kernels
    cannot take x's heads (a head or its rotated half not a power of two: the caller runs
    torch's steps). rotated_apart: `elementwise.HeadLaunch.rotated_apart` for the forward."""
    tables = head_tables(x, cos, sin, rope_dims)
    if tables is None:
        return None
    return _head_prep_op(x, *tables, gain, copies, rotated_apart)


@torch.library.custom_op("windowgpt::head_prep_pair", mutates_args=())
def _head_prep_pair_op(x: Tensor, cos: Tensor, sin: Tensor, gain: Optional[Tensor], q_heads: int,
                       copies: int, rotated_apart: bool) -> tuple[Tensor, Tensor]:
    launch = _launch(rotated_apart)
    return (head_prep(x[:, :, :q_heads], cos, sin, gain, x.dtype, launch),
            head_prep(x[:, :, q_heads:], cos, sin, None, x.dtype, launch, copies=copies))


@_head_prep_pair_op.register_fake
def _head_prep_pair_shapes(x, cos, sin, gain, q_heads, copies, rotated_apart):
    b, t, heads, head_dim = x.shape
    return x.new_empty(b, t, q_heads, head_dim), x.new_empty(b, t, (heads - q_heads) * copies, head_dim)


@torch.library.custom_op("windowgpt::head_prep_pair_backward", mutates_args=())
def _head_prep_pair_backward_op(grad_q: Tensor, grad_k: Tensor, x: Tensor, cos: Tensor, sin: Tensor,
                                gain: Optional[Tensor], q_heads: int) -> tuple[Tensor, Tensor]:
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _, dgain = head_prep_backward(grad_q, x[:, :, :q_heads], cos, sin, gain, dx=dx[:, :, :q_heads])
    head_prep_backward(grad_k, x[:, :, q_heads:], cos, sin, None, dx=dx[:, :, q_heads:])
    return dx, (dgain if dgain is not None else cos.new_empty(0))


@_head_prep_pair_backward_op.register_fake
def _head_prep_pair_backward_shapes(grad_q, grad_k, x, cos, sin, gain, q_heads):
    return x.new_empty(x.shape), (gain.new_empty(gain.shape) if gain is not None else cos.new_empty(0))


def _save_pair_for_backward(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:4])
    ctx.q_heads = inputs[4]
    ctx.shapes = tuple(out.shape for out in output)


def _head_prep_pair_grads(ctx, grad_q, grad_k):
    x, cos, sin, gain = ctx.saved_tensors
    grad_q, grad_k = (x.new_zeros(shape) if grad is None else grad for grad, shape in zip((grad_q, grad_k), ctx.shapes))
    dx, dgain = _head_prep_pair_backward_op(grad_q, grad_k, x, cos, sin, gain, ctx.q_heads)
    return dx, None, None, (dgain if gain is not None else None), None, None, None


_head_prep_pair_op.register_autograd(_head_prep_pair_grads, setup_context=_save_pair_for_backward)


def fused_head_prep_pair(x: Tensor, cos: Tensor, sin: Tensor, rope_dims: int, gain: Tensor | None, q_heads: int,
                         copies: int = 1, rotated_apart: bool = False) -> tuple[Tensor, Tensor] | None:
    """`model.ops.TorchOps.head_prep_pair` of x [B, T, q_heads + key heads, D] as one fused op:
    (the queries, the first q_heads heads, with gain; the keys, each `copies` times), in x's
    dtype, differentiable in x (one gradient tensor, x's shape) and gain; None where the
    kernels cannot take x's heads. rotated_apart: as `fused_head_prep`'s."""
    tables = head_tables(x, cos, sin, rope_dims)
    if tables is None:
        return None
    return _head_prep_pair_op(x, *tables, gain, q_heads, copies, rotated_apart)
