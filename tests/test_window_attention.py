"""The Triton sliding-window kernels compute `attention.may_attend`'s attention and its
gradients exactly.

On the CPU they run in Triton's interpreter with 16-wide blocks and are compared in float32
(and once in bfloat16) with SDPA under the explicit boolean mask. On CUDA (tests marked gpu) they are compared in
bfloat16 at the record model's shape with FlexAttention, both measured against a float32
reference.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from windowgpt_cli.model import attention
from windowgpt_cli.errors import ConfigError

from conftest import interpret_kernels_without_cuda

interpret_kernels_without_cuda()
INTERPRETED = not torch.cuda.is_available()

from windowgpt_cli.kernels.window_attention import Tuning, window_attention  # noqa: E402



def interpreted(own: int, loop: int, dq_own: int | None = None, dq_loop: int | None = None) -> Tuning:
    """Blocks for the interpreter: programs own `own` queries forward and keys for dK/dV,
    `dq_own` queries for dQ (own unless given), and loop over the other side `loop` (dq_loop)
    at a time."""
    dq_own, dq_loop = dq_own or own, dq_loop or loop
    return Tuning(fwd_block_m=own, fwd_block_n=loop, fwd_warps=1, fwd_stages=1, bwd_block_own=own,
                  bwd_block_loop=loop, bwd_warps=1, bwd_stages=1, dq_block_own=dq_own, dq_block_loop=dq_loop,
                  dq_warps=1, dq_stages=1)


TINY = interpreted(16, 16)
# Blocks of queries and keys of different sizes, either way round; dQ's apart from dK/dV's.
WIDE = interpreted(32, 16)
NARROW = interpreted(16, 32)
SPLIT = interpreted(32, 16, dq_own=16, dq_loop=32)


pytestmark = pytest.mark.usefixtures("interpreter_fixes")


def reference(q, k, v, window, sinks):
    """SDPA in float32 with the explicit mask, kv heads repeated over their groups."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.float().repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    mask = attention.window_mask(q.shape[1], window, sinks, q.device)
    return F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask).transpose(1, 2)


def inputs(seed, batch, seq_len, heads, kv_heads, head_dim=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((batch, seq_len, heads, head_dim), (batch, seq_len, kv_heads, head_dim),
              (batch, seq_len, kv_heads, head_dim))
    return [torch.randn(s, generator=g, device=device).to(dtype).requires_grad_() for s in shapes]


def outputs_and_grads(fn, q, k, v, grad):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


# (batch, T, H, Hkv, window, sinks, tuning): full causal; sinks 0; sinks outside and inside
# the window with T not a multiple of the blocks; sinks over two key blocks; a window longer
# than the sequence; windows wide enough for blocks that need no mask. GQA groups of 2 and 1.
# Sinks over several sequences and kv heads: the dK/dV kernel launches their sink blocks first.
# dQ's blocks other than dK/dV's.
CASES = [
    (2, 40, 2, 1, 0, 0, TINY),
    (1, 40, 2, 2, 5, 0, TINY),
    (2, 37, 4, 2, 9, 3, TINY),
    (1, 37, 2, 1, 9, 3, TINY),
    (1, 37, 2, 1, 12, 20, TINY),
    (1, 40, 2, 1, 100, 2, TINY),
    (1, 80, 2, 1, 40, 4, WIDE),
    (1, 61, 2, 1, 33, 20, NARROW),
    (2, 70, 4, 2, 24, 4, SPLIT),
]


@pytest.mark.parametrize("batch,seq_len,heads,kv_heads,window,sinks,tuning", CASES)
@pytest.mark.slow
def test_forward_and_gradients_match_masked_sdpa(batch, seq_len, heads, kv_heads, window, sinks, tuning):
    q, k, v = inputs(seq_len + window + sinks, batch, seq_len, heads, kv_heads)
    grad = torch.randn_like(q)
    got = outputs_and_grads(lambda *x: window_attention(*x, window, sinks, tuning), q, k, v, grad)
    want = outputs_and_grads(lambda *x: reference(*x, window, sinks), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a, b, atol=2e-5, rtol=0), (name, (a - b).abs().max().item())


def test_bfloat16_within_two_rounding_steps():
    """bf16 in and out (probabilities rounded to bf16 before the product with v, as in
    FlashAttention), against float32 from the same bf16 inputs."""
    q, k, v = (x.detach().bfloat16().requires_grad_() for x in inputs(7, 1, 40, 2, 1))
    grad = torch.randn_like(q)
    got = outputs_and_grads(lambda *x: window_attention(*x, 9, 3, TINY), q, k, v, grad)
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = outputs_and_grads(lambda *x: reference(*x, 9, 3), *exact, grad.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.bfloat16, name
        assert (a.float() - b).abs().max() <= 2 ** -6 * b.abs().max(), name


def test_saves_for_backward_only_where_grad_is_recorded():
    q, k, v = inputs(0, 1, 20, 2, 1)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.no_grad():
            assert window_attention(q, k, v, 5, 2, TINY).grad_fn is None
        with torch.inference_mode():
            window_attention(q, k, v, 5, 2, TINY)
        assert saved == []
        window_attention(q, k, v, 5, 2, TINY)
    assert len(saved) == 5  # q, k, v, out and the log-sum-exp


def test_compiles_into_one_graph_with_its_backward():
    """fullgraph=True fails on a graph break; the op's fake shapes and backward are traced."""
    q, k, v = inputs(1, 1, 37, 2, 1)
    grad = torch.randn_like(q)

    def loss(q, k, v):
        return (attention.attention(q, k, v, 9, 3, "triton") * grad).sum()

    # The kernels are the interpreter's here: no Inductor code to build around them.
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad((reference(q, k, v, 9, 3) * grad).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=2e-5, rtol=0)


def test_backend_needs_cuda():
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="attention backend triton needs CUDA"):
        attention.resolve_backend("triton", cpu)
    assert attention.resolve_backend("auto", cpu) == "sdpa"


# --- CUDA --------------------------------------------------------------------------------

def _errors_against_float32(fn, q, k, v, grad, window, sinks):
    got = outputs_and_grads(fn, q, k, v, grad)
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]  # float32 gradients too
    want = outputs_and_grads(lambda *x: reference(*x, window, sinks), *exact, grad.float())
    return [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window,sinks", [(512, 4), (0, 0), (100, 0)])
def test_record_shape_matches_flex_within_bf16_rounding(window, sinks):
    """bf16 at the record model's shape: the kernels' error against a float32 reference is
    about FlexAttention's (or SDPA's, for full causal attention)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = inputs(3, 2, 2048, 8, 4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn_like(q)
    if window:
        mask_mod = attention._window_mask_mod(window, sinks)
        block_mask = create_block_mask(mask_mod, None, None, 2048, 2048, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)

        def baseline(q, k, v):
            out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, enable_gqa=True)
            return out.transpose(1, 2)
    else:
        def baseline(q, k, v):
            return attention._sdpa(q, k, v, mask=None)
    ours = _errors_against_float32(lambda *x: window_attention(*x, window, sinks), q, k, v, grad, window, sinks)
    theirs = _errors_against_float32(baseline, q, k, v, grad, window, sinks)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert a <= 2 * b + 1e-3, (name, a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not attention.fa4_available(),
                    reason="needs CUDA and flash-attn-4")
@pytest.mark.parametrize("window,sinks", [(512, 4), (0, 0), (100, 0)])
def test_the_fa4_backend_matches_the_triton_kernels_within_bf16_rounding(window, sinks):
    """`--attn-backend fa4` at the record model's shape, eagerly and compiled in one graph:
    its error against a float32 reference is about the Triton kernels' (SDPA's where full)."""
    q, k, v = inputs(4, 2, 2048, 8, 4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn_like(q)

    def fa4(q, k, v):
        return attention.attention(q, k, v, window, sinks, "fa4")

    theirs = _errors_against_float32(lambda *x: attention.attention(*x, window, sinks, "triton"), q, k, v, grad,
                                     window, sinks)
    # With sinks dq is rounded to bf16 twice (FA4's, then with the sinks' share added), which
    # the Triton kernel, summing both inside, is not.
    factor = 3 if sinks else 2
    for fn in (fa4, torch.compile(fa4, fullgraph=True)):
        ours = _errors_against_float32(fn, q, k, v, grad, window, sinks)
        for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
            assert a <= factor * b + 1e-3, (name, a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_compiles_around_the_op_in_one_graph():
    q, k, v = inputs(4, 2, 1024, 8, 4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    grad = torch.randn_like(q)

    def loss(q, k, v):
        return (attention.attention(q, k, v, 256, 4, "triton").float() * grad.float()).sum()

    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_flex_calls_run_the_triton_kernels():
    q, k, v = inputs(5, 1, 512, 8, 4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert torch.equal(attention.attention(q, k, v, 128, 4, "flex"), window_attention(q, k, v, 128, 4))


def test_inference_launches_the_kernel_without_the_op_dispatch(monkeypatch):
    """The op's dispatch imports TorchDynamo at its first call; eager scoring needs neither."""
    from windowgpt_cli.kernels import window_attention as module

    def dispatched(*args):
        raise AssertionError("went through the custom op")

    q, k, v = (torch.randn(1, 24, heads, 16) for heads in (2, 1, 1))
    expected = window_attention(q, k, v, 5, 2, TINY)
    monkeypatch.setattr(module, "_attention_op", dispatched)
    with torch.inference_mode():
        assert torch.equal(window_attention(q, k, v, 5, 2, TINY), expected)
    with pytest.raises(AssertionError, match="custom op"):
        window_attention(q.requires_grad_(), k, v, 5, 2, TINY)


# --- Building the kernels ahead of the first call ----------------------------------------

KERNEL_NAMES = ("_attention_forward_kernel", "_attention_delta_kernel", "_attention_dkdv_kernel",
                "_attention_dq_kernel")


class LaunchRecorder:
    """Stands in for a kernel: notes its name at each launch, then launches it."""

    def __init__(self, kernel, name: str, launched: list[str]):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(self.name)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.slow
def test_each_build_launches_one_of_the_kernels_a_call_runs(monkeypatch, backward):
    """So that run_in_threads builds them side by side: one kernel per build, together
    those of a forward (and its backward)."""
    from windowgpt_cli.kernels import window_attention as module

    launched: list[str] = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(module, name, LaunchRecorder(getattr(module, name), name, launched))
    builds = module.kernel_builds(torch.device("cpu"), heads=2, kv_heads=1, head_dim=16, seq_len=40, window=9,
                                  sinks=3, backward=backward, dtype=torch.float32, tuning=TINY)
    per_build = []
    for build in builds:
        launched.clear()
        build()
        per_build.append(list(launched))
    assert all(len(names) == 1 for names in per_build)
    launched.clear()
    q, k, v = inputs(8, 3, 40, 2, 1)
    with contextlib.nullcontext() if backward else torch.no_grad():
        out = window_attention(q, k, v, 9, 3, TINY)
    if backward:
        out.sum().backward()
    assert sorted(names[0] for names in per_build) == sorted(launched) == sorted(KERNEL_NAMES[:4 if backward else 1])


def test_window_kernels_are_built_only_where_windowed_layers_run_them(monkeypatch):
    """The same rule as `attention.attention`'s: the triton backend always, flex only
    eagerly, nothing without Triton's GPU or windowed layers that differ from causal ones."""
    from windowgpt_cli.kernels import window_attention as module
    from windowgpt_cli.config import ModelConfig

    monkeypatch.setattr(module, "kernel_builds", lambda device, **sizes: [sizes])
    record = ModelConfig(window_attn_size=512, num_sink_tokens=4, window_attn_layers=(2, 4))
    cpu = torch.device("cpu")

    def builds(cfg, backend, seq_len=2048, eager=True, backward=True):
        return attention.window_kernel_builds(cfg, backend, seq_len, cpu, eager=eager, backward=backward)

    assert builds(record, "triton") == []  # no Triton GPU here
    monkeypatch.setattr(attention, "triton_available", lambda device: True)
    assert builds(record, "triton", eager=False) == [dict(heads=record.num_heads, kv_heads=record.num_kv_heads,
                                                         head_dim=record.head_dim, seq_len=2048, window=512,
                                                         sinks=4, backward=True)]
    assert builds(record, "flex", backward=False)[0]["backward"] is False
    assert builds(record, "flex", eager=False) == []  # FlexAttention traced into the compiled graph
    assert builds(record, "sdpa") == [] and builds(record, "fa3") == []
    assert builds(record, "triton", seq_len=512) == []  # the window covers every sequence
    assert builds(ModelConfig(), "triton") == []  # full attention everywhere


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_call_after_the_builds_builds_nothing():
    """The builds' zeros specialize the kernels as a real batch does (Triton keys a kernel
    on its arguments' dtypes and divisibility): a forward and backward of three sequences
    afterwards finds every kernel it runs already built."""
    from windowgpt_cli.kernels import window_attention as module
    from windowgpt_cli.runtime import run_in_threads

    device = torch.device("cuda")
    run_in_threads(module.kernel_builds(device, heads=8, kv_heads=4, head_dim=64, seq_len=1024, window=256,
                                        sinks=4, backward=True), device)
    kernels = [getattr(module, name) for name in KERNEL_NAMES]

    def built() -> list[int]:
        return [len(kernel.device_caches[torch.cuda.current_device()][0]) for kernel in kernels]

    before = built()
    q, k, v = inputs(9, 3, 1024, 8, 4, head_dim=64, dtype=torch.bfloat16, device="cuda")
    out = window_attention(q, k, v, 256, 4)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    assert min(before) >= 1 and built() == before
