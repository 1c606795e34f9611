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
    fake = types.SimpleNamespace(flash_attn_func=_FakeFA3.flash_attn_func)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake)
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


def test_triton_fa4_runs_windowed_layers_on_the_triton_kernels_and_full_ones_on_fa4(fake_fa4, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_triton_window", lambda q, k, v, window, sinks: calls.append(("triton", window))
                        or attention._sdpa(q, k, v, mask=attention.window_mask(q.shape[1], window, sinks, q.device)))
    fa4 = attention._fa4
    monkeypatch.setattr(attention, "_fa4",
                        lambda q, k, v, window: calls.append(("fa4", window)) or fa4(q, k, v, window))
    q, k, v = _qkv(24)
    full = attention.attention(q, k, v, 0, 0, "triton_fa4")
    windowed = attention.attention(q, k, v, 5, 3, "triton_fa4")
    assert calls == [("fa4", None), ("triton", 5)]
    assert torch.allclose(full.double(), naive_attention(q, k, v, 0, 0), atol=1e-5)
    assert torch.allclose(windowed.double(), naive_attention(q, k, v, 5, 3), atol=1e-5)
    assert attention.runs_window_kernels("triton_fa4", eager_on_cuda=False)


def test_the_configuration_offers_every_attention_backend():
    from windowgpt_cli.config import CHOICES

    assert CHOICES["attn_backend"] == attention.BACKENDS


def test_triton_fa4_needs_both_packages(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    monkeypatch.setattr(attention, "fa4_available", lambda: False)
    with pytest.raises(ConfigError, match="triton_fa4 needs CUDA and the flash-attn-4"):
        attention.resolve_backend("triton_fa4", cuda)
    monkeypatch.setattr(attention, "fa4_available", lambda: True)
    assert attention.resolve_backend("triton_fa4", cuda) == "triton_fa4"
    monkeypatch.setattr(attention, "triton_available", lambda device: False)
    with pytest.raises(ConfigError, match="triton_fa4 needs CUDA and the triton"):
        attention.resolve_backend("triton_fa4", cuda)


def test_fa4_needs_cuda_and_the_package(monkeypatch):
    monkeypatch.setattr(attention, "fa4_available", lambda: False)
    with pytest.raises(ConfigError, match="flash-attn-4"):
        attention.resolve_backend("fa4", torch.device("cuda"))
    monkeypatch.setattr(attention, "fa4_available", lambda: True)
    assert attention.resolve_backend("fa4", torch.device("cuda")) == "fa4"
    with pytest.raises(ConfigError, match="CUDA"):
        attention.resolve_backend("fa4", torch.device("cpu"))
    monkeypatch.setattr(attention, "fa3_available", lambda: False)
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    monkeypatch.setattr(attention, "fa4_loads", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.resolve_backend("auto", torch.device("cuda"), training=True) == "fa4"


@pytest.mark.parametrize("capability, training, chosen", [
    ((9, 0), True, "fa4"), ((10, 0), True, "fa4"), ((9, 0), False, "triton"),
    ((8, 0), True, "triton"), ((12, 0), True, "triton")])
def test_auto_trains_with_fa4_where_it_targets_the_gpu(monkeypatch, capability, training, chosen):
    """FA4's forward and backward beat cuDNN's full causal ones on Hopper (the record step
    2.3% shorter) and, with the sinks merged, the Triton window kernels (0.9% more); its
    forward alone does not, so scoring keeps cuDNN and Triton; other GPUs are not FA4's."""
    monkeypatch.setattr(attention, "fa3_available", lambda: False)
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    monkeypatch.setattr(attention, "fa4_available", lambda: True)
    monkeypatch.setattr(attention, "fa4_loads", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert attention.resolve_backend("auto", torch.device("cuda"), training=training) == chosen
    monkeypatch.setattr(attention, "fa4_loads", lambda: False)  # installed for another CUDA: not auto's
    assert attention.resolve_backend("auto", torch.device("cuda"), training=training) == "triton"
    monkeypatch.setattr(attention, "fa4_available", lambda: False)
    assert attention.resolve_backend("auto", torch.device("cuda"), training=training) == "triton"
    monkeypatch.setattr(attention, "fa3_available", lambda: True)  # the reference's kernel still comes first
    assert attention.resolve_backend("auto", torch.device("cuda"), training=training) == "fa3"


def test_fa4_loads_only_where_its_interface_imports(monkeypatch):
    from windowgpt_cli.kernels import flash4

    def broken():
        raise OSError("libcuda.so.13: cannot open shared object file")

    flash4.fa4_loads.cache_clear()
    monkeypatch.setattr(flash4, "_interface", broken)
    assert not flash4.fa4_loads()
    flash4.fa4_loads.cache_clear()
    monkeypatch.setattr(flash4, "_interface", lambda: object())
    assert flash4.fa4_loads()
    flash4.fa4_loads.cache_clear()
