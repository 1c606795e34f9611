"""Causal attention with optional sliding windows and sink tokens, on several backends.

All backends take q [B, T, H, D] and k, v [B, T, Hkv, D] (FlashAttention's layout, GQA
when Hkv < H) and agree on one rule: query i sees key j when j <= i and either
i - j <= window or j < sinks (window 0 means the whole causal prefix).

- fa3:  FlashAttention-3 (`flash_attn_interface`), when installed.
- fa4:  FlashAttention-4 (`flash_attn.cute`, the `fa4` extra), through `kernels.flash4`'s
  custom ops, the sinks outside a window merged by `kernels.attention_sinks`' Triton
  kernels. Auto picks it for training where FA4 is installed on a GPU it targets (Hopper,
  Blackwell): on an H200 the record model's step takes 0.9% less time than with the Triton
  window kernels (`triton_fa4`).
- flex: FlexAttention for windowed layers, SDPA (flash kernel) for full causal layers.
  Called eagerly on CUDA (sliding evaluation, test-time training), windowed layers run the
  Triton kernels instead, which start at once where FlexAttention compiles for seconds.
- triton: the Triton kernels of `window_attention` for windowed layers, SDPA for full
  causal layers.
- triton_fa4: the Triton kernels for windowed layers, FlashAttention-4 for full causal
  layers: on an H200 FA4's full causal forward and backward take 11% less time than
  cuDNN's, the record model's step 2.3% less. Scoring, forward alone, keeps cuDNN and the
  Triton kernels under auto (FA4's forward alone is slower).
- sdpa: SDPA everywhere, with an explicit boolean mask for windowed layers.

`attention_at` serves a few queries per sequence at given positions (SDPA with a mask,
on every backend): the last layer of sliding-window scoring.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelConfig
from ..errors import ConfigError
from ..runtime import hopper_or_blackwell, triton_available

BACKENDS = ("auto", "fa3", "fa4", "flex", "triton", "triton_fa4", "sdpa")
FA4_FULL_LAYERS = ("fa4", "triton_fa4")  # backends whose full causal layers run FA4
TRITON_WINDOWS = ("triton", "triton_fa4")  # backends whose windowed layers always run the Triton kernels


def fa3_available() -> bool:
    return importlib.util.find_spec("flash_attn_interface") is not None


def fa4_available() -> bool:
    from ..kernels.flash4 import fa4_available as available  # imports no kernel package

    return available()


def fa4_loads() -> bool:
    from ..kernels.flash4 import fa4_loads as loads  # imports the kernel package: only where auto asks

    return loads()


def fa4_targets(device: torch.device) -> bool:
    """Whether FlashAttention-4 is installed, loads, and builds for this GPU (sm_90, sm_100)."""
    return hopper_or_blackwell(device) and fa4_available() and fa4_loads()


def resolve_backend(name: str, device: torch.device, training: bool = False) -> str:
    """The backend to use on this device (for a training step where `training`: auto then
    takes FA4's backward where it can); a named backend that cannot run is an error."""
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} must be one of {', '.join(BACKENDS)}")
    if name == "auto":
        if device.type != "cuda":
            return "sdpa"
        if fa3_available():
            return "fa3"
        if not triton_available(device):
            return "flex"
        return "fa4" if training and fa4_targets(device) else "triton"
    if name == "fa3" and (device.type != "cuda" or not fa3_available()):
        raise ConfigError("attention backend fa3 needs CUDA and the flash_attn_interface package (FlashAttention-3)")
    if name in FA4_FULL_LAYERS and (device.type != "cuda" or not fa4_available()):
        raise ConfigError(f"attention backend {name} needs CUDA and the flash-attn-4 package "
                          "(pip install 'windowgpt[fa4]')")
    if name in TRITON_WINDOWS and not triton_available(device):
        raise ConfigError(f"attention backend {name} needs CUDA and the triton package")
    return name


def covers_everything(seq_len: int, window: int) -> bool:
    """A window at least as long as the sequence is plain causal attention."""
    return window <= 0 or window + 1 >= seq_len


def attention(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int, backend: str) -> Tensor:
    seq_len = q.shape[1]
    if covers_everything(seq_len, window):
        if backend in FA4_FULL_LAYERS:
            return _fa4(q, k, v, window=None)[0]
        return _fa3(q, k, v) if backend == "fa3" else _sdpa(q, k, v, mask=None)
    if backend == "fa3":
        return _fa3_window_with_sinks(q, k, v, window, sinks)
    if backend == "fa4":
        if sinks <= 0:
            return _fa4(q, k, v, window)[0]
        return _fa4_window_sinks(q, k, v, window, sinks)
    if runs_window_kernels(backend, eager_on_cuda=_eager_on_cuda(q)):
        return _triton_window(q, k, v, window, sinks)
    if backend == "flex":
        return _flex(q, k, v, _flex_block_mask(seq_len, window, sinks, q.device))
    return _sdpa(q, k, v, mask=window_mask(seq_len, window, sinks, q.device))


def may_attend(i: Tensor, j: Tensor, window: int, sinks: int) -> Tensor:
    """The rule every backend follows: True where query position i may see key position j
    (broadcast against each other)."""
    causal = j <= i
    return causal if window <= 0 else causal & (((i - j) <= window) | (j < sinks))


def window_mask(seq_len: int, window: int, sinks: int, device: torch.device) -> Tensor:
    """Boolean [T, T] mask: True where query i may attend to key j."""
    positions = torch.arange(seq_len, device=device)
    return may_attend(positions[:, None], positions[None, :], window, sinks)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = kt.shape[1] != qt.shape[1]
    if mask is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


# --- Triton ------------------------------------------------------------------------------

def runs_window_kernels(backend: str, eager_on_cuda: bool) -> bool:
    """Whether windowed layers on this backend run `window_attention`'s Triton kernels:
    always on `triton` and `triton_fa4`; on `flex` where it is called eagerly on CUDA."""
    return backend in TRITON_WINDOWS or (backend == "flex" and eager_on_cuda)


def _eager_on_cuda(q: Tensor) -> bool:
    """An eager call on CUDA, where FlexAttention would compile its kernel at the first call:
    the Triton kernels serve it (inside a compiled model FlexAttention is traced instead)."""
    return q.is_cuda and not torch.compiler.is_compiling() and triton_available(q.device)


def _triton_window(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
    from ..kernels.window_attention import window_attention  # imports Triton: only when used

    return window_attention(q, k, v, window, sinks)


def window_kernel_builds(cfg: ModelConfig, backend: str, seq_len: int, device: torch.device, *, eager: bool,
                         backward: bool) -> list[Callable[[], object]]:
    """The builds (`window_attention.kernel_builds`) of the Triton kernels that cfg's windowed
    layers run over sequences of seq_len on this backend, called eagerly or compiled; none
    where they run no Triton kernel."""
    if (not triton_available(device) or not runs_window_kernels(backend, eager_on_cuda=eager)
            or not cfg.window_attn_layers or covers_everything(seq_len, cfg.window_attn_size)):
        return []
    from ..kernels.window_attention import kernel_builds

    return kernel_builds(device, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         seq_len=seq_len, window=cfg.window_attn_size, sinks=cfg.num_sink_tokens, backward=backward)


# --- FlexAttention -----------------------------------------------------------------------

@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _window_mask_mod(window: int, sinks: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return may_attend(q_idx, kv_idx, window, sinks)

    return mask_mod


_BLOCK_MASKS: dict[tuple, object] = {}


def _flex_block_mask(seq_len: int, window: int, sinks: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = _window_mask_mod(window, sinks)
    if torch.compiler.is_compiling():  # traced into the caller's graph
        return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    key = (seq_len, window, sinks, str(device))
    if key not in _BLOCK_MASKS:
        with torch.inference_mode(False):  # usable by autograd later, e.g. test-time training
            _BLOCK_MASKS[key] = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    return _BLOCK_MASKS[key]


def _flex(q: Tensor, k: Tensor, v: Tensor, block_mask) -> Tensor:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    # Inside a compiled model flex_attention is traced into the graph; called eagerly on
    # CUDA (without Triton's kernels, see `attention`) it needs its own compiled kernel.
    flex = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else _eager_flex()
    out = flex(qt, kt, vt, block_mask=block_mask, enable_gqa=kt.shape[1] != qt.shape[1])
    return out.transpose(1, 2)


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


# --- FlashAttention-3 --------------------------------------------------------------------

def _fa3_module():
    return importlib.import_module("flash_attn_interface")


def _fa3_call(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
    result = _fa3_module().flash_attn_func(q, k, v, causal=True, **kwargs)
    if isinstance(result, tuple):
        return result[0], (result[1] if len(result) > 1 else None)
    return result, None


def _fa3(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return _fa3_call(q, k, v)[0]


def _fa3_window_with_sinks(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
    """FA3 has no sink tokens: attend within the window with FA3, then `merge_sinks`."""
    if sinks <= 0:
        return _fa3_call(q, k, v, window_size=(window, window))[0]
    y_win, lse_win = _fa3_call(q, k, v, window_size=(window, window), return_attn_probs=True)
    assert lse_win is not None, "flash_attn_func did not return the log-sum-exp"
    return merge_sinks(q, k, v, window, sinks, y_win, lse_win)


# --- FlashAttention-4 --------------------------------------------------------------------

def _fa4(q: Tensor, k: Tensor, v: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
    """FA4's (output, log-sum-exp [B, H, T]) over the window (None: the whole causal prefix)."""
    from ..kernels.flash4 import FULL, fa4_attention  # imports flash_attn.cute at the first call

    return fa4_attention(q, k, v, FULL if window is None else window)


def _fa4_window_sinks(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int) -> Tensor:
    """FA4 over the window, the sinks outside it merged by Triton kernels (`kernels.flash4`)."""
    from ..kernels.flash4 import fa4_window_sinks  # imports flash_attn.cute at the first call

    return fa4_window_sinks(q, k, v, window, sinks)[0]


# --- Sink tokens beside a window kernel -----------------------------------------------------

def merge_sinks(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int, y_win: Tensor, lse_win: Tensor) -> Tensor:
    """Attention over the window and the sinks, from the window's output y_win [B, T, H, D]
    and log-sum-exp lse_win [B, H, T]: attend to the sinks that lie outside the window
    directly (there are only a few) and merge the two softmaxes through their log-sum-exps."""
    lse_win = lse_win.transpose(1, 2).float()  # [B, T, H]
    b, t, h, d = q.shape
    group = h // k.shape[2]
    k_sink = k[:, :sinks].repeat_interleave(group, dim=2)  # [B, S, H, D]
    v_sink = v[:, :sinks].repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bths", q.float(), k_sink.float()) * d ** -0.5
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(sinks, device=q.device)[None, :]
    outside_window = (j < i - window)[None, :, None, :]  # sinks the window pass did not see
    scores = scores.masked_fill(~outside_window, float("-inf"))
    lse_sink = torch.logsumexp(scores, dim=-1)  # -inf where no sink is outside the window
    y_sink = torch.einsum("bths,bshd->bthd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v_sink.float())
    total = torch.logaddexp(lse_win, lse_sink)
    w_win = torch.exp(lse_win - total)[..., None]
    w_sink = torch.exp(lse_sink - total)[..., None]
    return (w_win * y_win.float() + w_sink * y_sink).to(q.dtype)


def attention_at(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, window: int, sinks: int) -> Tensor:
    """Attention for a few queries per sequence: q [B, K, H, D] at positions [B, K] of the
    sequences whose keys and values are k, v [B, T, Hkv, D]; the same rule as `attention`."""
    keys = torch.arange(k.shape[1], device=q.device)
    visible = may_attend(positions[:, None, :, None], keys, window, sinks)  # [B, 1, K, T]
    group = q.shape[2] // k.shape[2]
    if group > 1:  # the heads of a group share keys and values
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible)
    return out.transpose(1, 2)
