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


class _FakeFA4:
    """flash_attn.cute.interface's calling convention, computed in float64 from FlashAttention's
    formulas: the forward returns the log-sum-exp; the backward recomputes the probabilities
    from the log-sum-exp it is given and takes the log-sum-exp's gradient."""

    @staticmethod
    def _scores(q, k, window_left):
        b, t, h, d = q.shape
        kk = k.double().repeat_interleave(h // k.shape[2], dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), kk) / math.sqrt(d)
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (j <= i) & (True if window_left is None else (i - j <= window_left))
        return scores.masked_fill(~allowed, float("-inf")), kk

    @staticmethod
    def flash_attn_func(q, k, v, causal=False, window_size=(None, None), return_lse=False):
        assert causal and window_size[1] is None
        q.data_ptr()  # as FA4 does: a traced tensor has none, so the call must stay opaque
        scores, _ = _FakeFA4._scores(q, k, window_size[0])
        lse = scores.logsumexp(-1)  # [B, H, T]
        vv = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        out = torch.einsum("bhij,bjhd->bihd", (scores - lse[..., None]).exp(), vv)
        return out.to(q.dtype), lse.float()

    @staticmethod
    def _flash_attn_bwd(q, k, v, out, dout, lse, causal=False, window_size_left=None, window_size_right=None,
                        dlse=None):
        assert causal and window_size_right is None
        dout.data_ptr()  # as FA4 does (see flash_attn_func)
        h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
        scores, kk = _FakeFA4._scores(q, k, window_size_left)
        p = (scores - lse.double()[..., None]).exp()  # [B, H, I, J]
        vv = v.double().repeat_interleave(h // hkv, dim=2)
        do = dout.double()
        dv = torch.einsum("bhij,bihd->bjhd", p, do)
        dp = torch.einsum("bihd,bjhd->bhij", do, vv)
        delta = (do * out.double()).sum(-1).transpose(1, 2)  # [B, H, I]
        if dlse is not None:
            delta = delta - dlse.double()
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhij,bjhd->bihd", ds, kk) / math.sqrt(d)
        dk = torch.einsum("bhij,bihd->bjhd", ds, q.double()) / math.sqrt(d)
        fold = lambda x: x.unflatten(2, (hkv, h // hkv)).sum(3)  # noqa: E731  the group's heads share k, v
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


@pytest.fixture
def fake_fa4(monkeypatch):
    interface = types.SimpleNamespace(flash_attn_func=_FakeFA4.flash_attn_func,
                                      _flash_attn_bwd=_FakeFA4._flash_attn_bwd)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


def _gradients(q, k, v, window, sinks, backend):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attention.attention(*leaves, window, sinks, backend)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weighs every output
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("window,sinks", CASES)
def test_fa4_path_gives_the_outputs_and_gradients_of_sdpa(fake_fa4, window, sinks):
    """Sinks merged through FA4's log-sum-exp: the window's scores get their gradient through
    the log-sum-exp as well as through the output."""
    q, k, v = _qkv(200 + window + sinks)
    got, got_grads = _gradients(q, k, v, window, sinks, "fa4")
    want, want_grads = _gradients(q, k, v, window, sinks, "sdpa")
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert torch.allclose(g, w, atol=1e-5, rtol=0), name


def test_fa4_op_stays_in_one_compiled_graph(fake_fa4):
    q, k, v = (x.requires_grad_(True) for x in _qkv(7))
    compiled = torch.compile(lambda a, b, c: attention.attention(a, b, c, 5, 3, "fa4"), backend="aot_eager",
                             fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    assert torch.allclose(out.detach().double(), naive_attention(q.detach(), k.detach(), v.detach(), 5, 3), atol=1e-5)
    assert q.grad is not None and torch.isfinite(q.grad).all()


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
    assert attention.resolve_backend("auto", torch.device("cuda"), training=True) == "triton_fa4"  # never fa4


@pytest.mark.parametrize("capability, training, chosen", [
    ((9, 0), True, "triton_fa4"), ((10, 0), True, "triton_fa4"), ((9, 0), False, "triton"),
    ((8, 0), True, "triton"), ((12, 0), True, "triton")])
def test_auto_trains_with_fa4_for_full_layers_where_it_targets_the_gpu(monkeypatch, capability, training, chosen):
    """FA4's full causal forward and backward beat cuDNN's on Hopper (the record step 2.3%
    shorter); its forward alone does not, so scoring keeps cuDNN; other GPUs are not FA4's."""
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
