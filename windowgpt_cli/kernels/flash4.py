"""FlashAttention-4's causal attention (the `flash-attn-4` package, `flash_attn.cute`) as a
torch custom op, `windowgpt::fa4_attention`, that returns the output and its log-sum-exp,
both differentiable, so that torch.compile keeps a step that calls it in one graph.

The sink tokens of a windowed layer are not FA4's: `fa4_window_sinks` runs FA4 over the
window and `attention_sinks`' Triton kernels over the sinks outside it, merged through the
log-sum-exps forward, and backward FA4's kernels handed the merged output and log-sum-exp
(the window keys' exact gradients) with the sinks' share added. FA4's public function has no
backward of its own to call; the ops' backwards call the package's `_flash_attn_bwd`, an
internal function, which is why the `fa4` extra pins its version.

Nothing here knows the model. The package is imported at the first call.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
from torch import Tensor

from ..runtime import imports_cleanly

FULL = -1  # window for plain causal attention


def fa4_available() -> bool:
    """Whether `flash_attn.cute` (flash-attn-4) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


@functools.cache
def fa4_loads() -> bool:
    """Whether FA4's interface imports here: the package may be installed for another CUDA
    or torch, where only a named `--attn-backend fa4` should fail, never `auto`."""
    return imports_cleanly(_interface)


def _interface():
    return importlib.import_module("flash_attn.cute.interface")


def _left(window: int) -> int | None:
    return None if window == FULL else window


@torch.library.custom_op("windowgpt::fa4_attention", mutates_args=())
def fa4_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """q [B, T, H, D], k, v [B, T, Hkv, D]: (out [B, T, H, D], lse [B, H, T] float32) of
    causal attention in which query i sees keys i - window .. i (all of them for FULL)."""
    out, lse = _interface().flash_attn_func(q, k, v, causal=True, window_size=(_left(window), None),
                                             return_lse=True)
    return out, lse


@fa4_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, window: int) -> tuple[Tensor, Tensor]:
    b, t, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, t), dtype=torch.float32)


# The backward is an op of its own too: torch.compile traces a registered backward function,
# and FA4's functions read their tensors' data pointers, which traced tensors do not have.
@torch.library.custom_op("windowgpt::fa4_attention_backward", mutates_args=())
def fa4_attention_backward(dout: Tensor, dlse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v from those of the output and the log-sum-exp."""
    return _interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, causal=True,
                                        window_size_left=_left(window), window_size_right=None,
                                        dlse=dlse.contiguous())


@fa4_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window = window


def _backward(ctx, dout: Tensor | None, dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = torch.zeros_like(lse) if dlse is None else dlse  # an lse gradient of 0 changes nothing
    dq, dk, dv = fa4_attention_backward(dout, dlse, q, k, v, out, lse, ctx.window)
    return dq, dk, dv, None


fa4_attention.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("windowgpt::fa4_window_sinks", mutates_args=())
def fa4_window_sinks(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention in which query i sees keys i - window .. i and the first
    `sinks` keys (`attention.may_attend`'s rule, window > 0)."""
    from .attention_sinks import merge_sinks_  # imports Triton

    out, lse = _interface().flash_attn_func(q, k, v, causal=True, window_size=(window, None), return_lse=True)
    merge_sinks_(q, k, v, out, lse, window, sinks)
    return out, lse


@fa4_window_sinks.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> tuple[Tensor, Tensor]:
    b, t, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("windowgpt::fa4_window_sinks_backward", mutates_args=())
def fa4_window_sinks_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, window: int,
                              sinks: int) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k, v from the output's: FA4's over the window, from the merged
    output and log-sum-exp, plus the sinks'."""
    from .attention_sinks import add_sink_grads_

    dout = dout.contiguous()
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=window,
                                              window_size_right=None)
    add_sink_grads_(dq, dk, dv, q, k, v, out, dout, lse, window, sinks)
    return dq, dk, dv


@fa4_window_sinks_backward.register_fake
def _(dout, q, k, v, out, lse, window, sinks):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_sinks(ctx, inputs, output) -> None:
    q, k, v, window, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.window, ctx.sinks = window, sinks


def _backward_sinks(ctx, dout: Tensor | None, dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout  # the lse is for the backward, not a result to train
    dq, dk, dv = fa4_window_sinks_backward(dout, q, k, v, out, lse, ctx.window, ctx.sinks)
    return dq, dk, dv, None, None


fa4_window_sinks.register_autograd(_backward_sinks, setup_context=_setup_sinks)
