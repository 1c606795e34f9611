"""Every attention backend computes causal + window + sink attention with GQA exactly."""
import math
import sys
import types

import pytest
import torch

from windowgpt_cli.model import attention
from windowgpt_cli.errors import ConfigError


def naive_attention(q, k, v, window, sinks):
    """Loops over queries in float64: query i sees j <= i with i - j <= window or j < sinks."""
    b, t, h, d = q.shape
    group = h // k.shape[2]
    k = k.double().repeat_interleave(group, dim=2)
    v = v.double().repeat_interleave(group, dim=2)
    q = q.double()
    out = torch.zeros(b, t, h, d, dtype=torch.float64)
    for i in range(t):
        visible = [j for j in range(i + 1) if window <= 0 or i - j <= window or j < sinks]
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, visible]) / math.sqrt(d)
        out[:, i] = torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v[:, visible])
    return out


CASES = [(0, 0), (5, 0), (5, 3), (12, 2), (40, 4)]  # (window, sinks); 40 covers the whole sequence


def _qkv(seed, t=24, h=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, t, h, d, generator=g), torch.randn(2, t, hkv, d, generator=g),
            torch.randn(2, t, hkv, d, generator=g))


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("window,sinks", CASES)
@pytest.mark.slow
def test_cpu_backends_match_naive(backend, window, sinks):
    q, k, v = _qkv(window * 10 + sinks)
    got = attention.attention(q, k, v, window, sinks, backend)
    want = naive_attention(q, k, v, window, sinks)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


class _FakeFA3:
    """flash_attn_interface's calling convention, computed naively, without sink support:
    the windowed path must combine the sinks itself."""

    @staticmethod
    def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), return_attn_probs=False):
        window = window_size[0] if window_size[0] >= 0 else 0
        out = naive_attention(q, k, v, window, 0).to(q.dtype)
        if not return_attn_probs:
            return out
        b, t, h, d = q.shape
        kk = k.double().repeat_interleave(h // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), kk) / math.sqrt(d)
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        allowed = (j <= i) & ((window <= 0) | (i - j <= window))
        lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # [B, H, T]
        return out, lse.float()


@pytest.mark.parametrize("window,sinks", CASES)
def test_fa3_path_combines_sinks_exactly(monkeypatch, window, sinks):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_func=_FakeFA3.flash_attn_func))
    q, k, v = _qkv(100 + window + sinks)
    got = attention.attention(q, k, v, window, sinks, "fa3")
    want = naive_attention(q, k, v, window, sinks)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


def test_backend_resolution():
    cpu = torch.device("cpu")
    assert attention.resolve_backend("auto", cpu) == "sdpa"
    assert attention.resolve_backend("flex", cpu) == "flex"
    with pytest.raises(ConfigError, match="fa3"):
        attention.resolve_backend("fa3", cpu)
    with pytest.raises(ConfigError):
        attention.resolve_backend("nope", cpu)


def test_auto_prefers_fa3_then_the_triton_window_kernels_on_cuda(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "fa3_available", lambda: False)
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    assert attention.resolve_backend("auto", cuda) == "triton"
    monkeypatch.setattr(attention, "triton_available", lambda device: False)
    assert attention.resolve_backend("auto", cuda) == "flex"
    monkeypatch.setattr(attention, "fa3_available", lambda: True)
    assert attention.resolve_backend("auto", cuda) == "fa3"
