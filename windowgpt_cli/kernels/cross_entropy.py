"""The soft-capped cross-entropy as two Triton kernels (forward, backward), one program per
row of logits, as an op torch.compile keeps opaque (`softcap_cross_entropy`).

The model's loss is cross_entropy(cap * tanh(logits / cap)) over the vocabulary. Done by
separate steps, the logits' rows are read and written several times (the cap, the
log-sum-exp, the gradient); here the forward reads each row once (an online log-sum-exp over
blocks of the vocabulary) and keeps only the loss and the log-sum-exp per row, and the
backward reads each row once more and writes its gradient. Everything is computed in
float32 from the stored logits; the gradient is rounded once, to the logits' dtype. A row
whose target is negative (F.cross_entropy's ignore_index, -100: the rows that pad a batch)
is ignored as torch ignores it: loss 0, gradient 0.
`head_softcap_cross_entropy` goes one step further: the output layer's product and the loss
over chunks of rows, each chunk's logits made, scored and differentiated while they are
small, so that the logits of all rows are never stored.
Importing this module imports Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..runtime import matmul_dtype

BLOCK_V = 1024  # vocabulary entries a program handles at a time
NOTHING: tl.constexpr = tl.constexpr(-1e30)  # a logit below every capped one, finite so that differences stay numbers


@triton.jit
def _capped(x, cap):
    """cap * tanh(x / cap), tanh through exp (1 - 2 / (e^2u + 1)), exact at both ends."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))


@triton.jit
def _cross_entropy_forward_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, row_stride, vocab, cap,
                                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    # Per lane, the largest capped logit so far and the sum of exp(z - it). Capped logits lie
    # within +-cap, so NOTHING (for lanes past the vocabulary) is below them all and adds 0.
    running_max = tl.full((BLOCK,), NOTHING, tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _capped(tl.load(base + cols, mask=cols < vocab, other=0.0).to(tl.float32), cap)
        z = tl.where(cols < vocab, z, NOTHING)
        new_max = tl.maximum(running_max, z)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(z - new_max)
        running_max = new_max
    top = tl.max(running_max, axis=0)
    lse = top + tl.log(tl.sum(running_sum * tl.exp(running_max - top), axis=0))
    target = tl.load(targets_ptr + row)
    scored = target >= 0
    z_target = _capped(tl.load(base + tl.where(scored, target, 0)).to(tl.float32), cap)
    tl.store(loss_ptr + row, tl.where(scored, lse - z_target, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_backward_kernel(grad_loss_ptr, logits_ptr, targets_ptr, lse_ptr, grad_ptr, row_stride,
                                   grad_row_stride, vocab, cap, BLOCK: tl.constexpr):
    """d loss / d logits = g (softmax(z) - onehot(target)) (1 - (z / cap)^2), z the capped
    logits; 0 where the target is ignored."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    g = tl.where(target >= 0, tl.load(grad_loss_ptr + row), 0.0)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        z = _capped(tl.load(logits_ptr + row * row_stride + cols, mask=live, other=0.0).to(tl.float32), cap)
        p = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
        scaled = z / cap
        tl.store(grad_ptr + row * grad_row_stride + cols, g * p * (1.0 - scaled * scaled), mask=live)


def _block(vocab: int) -> int:
    """The vocabulary entries a program reads at a time."""
    return min(BLOCK_V, triton.next_power_of_2(vocab))


def _forward(logits: Tensor, targets: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    rows, vocab = logits.shape
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    if rows:
        _cross_entropy_forward_kernel[(rows,)](logits, targets, loss, lse, logits.stride(0), vocab, cap,
                                               BLOCK=_block(vocab))
    return loss, lse


def _backward(grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, cap: float) -> Tensor:
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)
    if rows:
        _cross_entropy_backward_kernel[(rows,)](grad_loss.contiguous(), logits, targets, lse, grad, logits.stride(0),
                                                grad.stride(0), vocab, cap, BLOCK=_block(vocab))
    return grad


# --- The custom op -----------------------------------------------------------------------
# Opaque to torch.compile (its fake implementation gives the shapes), with its own backward
# op, so a compiled model keeps one graph.

@torch.library.custom_op("windowgpt::softcap_cross_entropy", mutates_args=())
def _loss_op(logits: Tensor, targets: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    return _forward(logits, targets, cap)


@_loss_op.register_fake
def _loss_shapes(logits, targets, cap):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("windowgpt::softcap_cross_entropy_backward", mutates_args=())
def _loss_backward_op(grad_loss: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, cap: float) -> Tensor:
    return _backward(grad_loss, logits, targets, lse, cap)


@_loss_backward_op.register_fake
def _loss_backward_shapes(grad_loss, logits, targets, lse, cap):
    return logits.new_empty(logits.shape)


def _save_for_backward(ctx, inputs, output) -> None:
    logits, targets, cap = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.cap = cap


def _loss_grads(ctx, grad_loss, grad_lse):
    logits, targets, lse = ctx.saved_tensors
    return _loss_backward_op(grad_loss, logits, targets, lse, ctx.cap), None, None


_loss_op.register_autograd(_loss_grads, setup_context=_save_for_backward)


def softcap_cross_entropy(logits: Tensor, targets: Tensor, cap: float) -> Tensor:
    """Per-row cross-entropy [N] (float32) of cap * tanh(logits / cap) for logits [N, V]
    (any float dtype, rows contiguous) and targets [N]; differentiable in logits. A row with
    a negative target is ignored: its loss is 0 and so is its gradient."""
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits [N, V] and targets [N]: got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _loss_op(logits, targets.to(torch.int64).contiguous(), float(cap))[0]


# --- The output layer and the loss, chunk by chunk -------------------------------------------
# With the logits [N, V] whole, the forward writes them, the loss reads them, its backward
# reads them again and writes their gradient, which two products read. Here one op makes a
# chunk's logits, scores them and takes their gradient back through the output layer before
# the next chunk, so only a chunk's logits exist at a time. The loss is a sum, so its
# gradient is known up to the one factor the backward brings: the forward keeps the
# gradients of the sum (hidden's [N, D], the weight's [V, D] in float32) and the backward
# scales them.

@torch.library.custom_op("windowgpt::head_softcap_cross_entropy", mutates_args=())
def _head_loss_op(hidden: Tensor, weight: Tensor, targets: Tensor, cap: float,
                  chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    rows = hidden.shape[0]
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
    ones = torch.ones(min(chunk_rows, rows), device=hidden.device, dtype=torch.float32)
    for start in range(0, rows, chunk_rows):
        h, t = hidden[start:start + chunk_rows], targets[start:start + chunk_rows]
        logits = h @ weight.t()
        losses, lse = _forward(logits, t, cap)
        total += losses.sum()
        grad_logits = _backward(ones[:h.shape[0]], logits, t, lse, cap)
        grad_hidden[start:start + chunk_rows] = grad_logits @ weight
        grad_weight += (grad_logits.t() @ h).float()
    return total, grad_hidden, grad_weight


@_head_loss_op.register_fake
def _head_loss_shapes(hidden, weight, targets, cap, chunk_rows):
    return (hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden),
            weight.new_empty(weight.shape, dtype=torch.float32))


def _save_head_grads(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], output[2])
    ctx.weight_dtype = inputs[1].dtype


def _head_loss_grads(ctx, grad_total, grad_of_grad_hidden, grad_of_grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    return ((grad_hidden.float() * grad_total).to(grad_hidden.dtype), (grad_weight * grad_total).to(ctx.weight_dtype),
            None, None, None)


_head_loss_op.register_autograd(_head_loss_grads, setup_context=_save_head_grads)


def head_softcap_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, cap: float,
                               chunk_rows: int) -> Tensor:
    """The summed cross-entropy (float32 []) of cap * tanh(hidden @ weight.T / cap) for hidden
    [N, D], the output layer's weight [V, D] and targets [N] (negative: ignored), made
    chunk_rows rows at a time; differentiable in hidden and weight. Under autocast the
    product runs in autocast's dtype, as F.linear's would."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden [N, D], weight [V, D] and targets [N]: got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    dtype = matmul_dtype(hidden)
    return _head_loss_op(hidden.to(dtype).contiguous(), weight.to(dtype).contiguous(),
                         targets.to(torch.int64).contiguous(), float(cap), int(chunk_rows))[0]
