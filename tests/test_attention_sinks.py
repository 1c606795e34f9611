"""The sink tokens beside FlashAttention-4's window (`kernels.attention_sinks`, the `fa4`
backend's windowed layers): the merge forward and the sinks' share of the gradients, on top
of a window pass, give `attention.may_attend`'s attention and its gradients.

Without CUDA the kernels run in Triton's interpreter and FA4 is `fake_fa4.FakeFA4`
(FlashAttention's formulas in float64: its backward recomputes the probabilities from the
log-sum-exp it is handed, as FA4's does, which is what the sinks' backward relies on). On
CUDA with flash-attn-4, tests/test_window_attention.py's gpu test runs the `fa4` backend
against the Triton window kernels at the record model's shape.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from windowgpt_cli.model import attention

from conftest import count_launches, interpret_kernels_without_cuda

interpret_kernels_without_cuda()

from fake_fa4 import FakeFA4  # noqa: E402
from windowgpt_cli.kernels import attention_sinks  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")

# (T, H, Hkv, window, sinks): rows past one block of 64 and not a multiple of it; sinks that
# reach into the window of the first rows after it; one sink; GQA groups of 2 and 1; more
# sinks than keys before the window; a window that leaves one row outside.
CASES = [(90, 4, 2, 5, 3), (70, 2, 2, 12, 1), (40, 4, 1, 8, 4), (24, 2, 1, 3, 6), (30, 2, 2, 28, 2)]


def qkv(seed, t, h, hkv, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, t, h, d, generator=g).to(dtype), torch.randn(2, t, hkv, d, generator=g).to(dtype),
            torch.randn(2, t, hkv, d, generator=g).to(dtype))


def reference(q, k, v, window, sinks):
    """SDPA in float32 under the rule's boolean mask, kv heads repeated over their groups."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.float().repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    mask = attention.window_mask(q.shape[1], window, sinks, q.device)
    return F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=mask).transpose(1, 2)


def outputs_and_grads(fn, q, k, v):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weighs every output
    (out.float() * weights).sum().backward()
    return out.detach().float(), *[x.grad.float() for x in leaves]


@pytest.mark.parametrize("t, h, hkv, window, sinks", CASES)
def test_the_merge_turns_the_windows_output_and_lse_into_those_with_the_sinks(t, h, hkv, window, sinks):
    q, k, v = qkv(t + window, t, h, hkv)
    out, lse = FakeFA4.flash_attn_func(q, k, v, causal=True, window_size=(window, None), return_lse=True)
    attention_sinks.merge_sinks_(q, k, v, out, lse, window, sinks)
    assert torch.allclose(out, reference(q, k, v, window, sinks), atol=1e-5, rtol=0)
    scores = FakeFA4._scores(q, k, None)[0]  # every causal key, then the rule's mask
    positions = torch.arange(t)
    visible = attention.may_attend(positions[:, None], positions[None, :], window, sinks)
    assert torch.allclose(lse, scores.masked_fill(~visible, float("-inf")).logsumexp(-1).float(), atol=1e-5)


@pytest.mark.parametrize("t, h, hkv, window, sinks", CASES)
def test_the_sinks_share_completes_the_window_backward_from_the_merged_output(t, h, hkv, window, sinks):
    """FA4's backward over the window handed the merged output and log-sum-exp, plus the
    sinks' share: the gradients of attention with the sinks."""
    q, k, v = qkv(3 * t + sinks, t, h, hkv)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(t))
    out, lse = FakeFA4.flash_attn_func(q, k, v, causal=True, window_size=(window, None), return_lse=True)
    attention_sinks.merge_sinks_(q, k, v, out, lse, window, sinks)
    dq, dk, dv = FakeFA4._flash_attn_bwd(q, k, v, out, grad, lse, causal=True, window_size_left=window)
    attention_sinks.add_sink_grads_(dq, dk, dv, q, k, v, out, grad, lse, window, sinks)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, window, sinks), leaves, grad)
    for name, got, expected in zip("qkv", (dq, dk, dv), want):
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("t, h, hkv, window, sinks", CASES[:3])
def test_the_fa4_backend_gives_the_outputs_and_gradients_of_sdpa(fake_fa4, t, h, hkv, window, sinks):
    q, k, v = qkv(200 + window + sinks, t, h, hkv)
    got = outputs_and_grads(lambda *x: attention.attention(*x, window, sinks, "fa4"), q, k, v)
    want = outputs_and_grads(lambda *x: attention.attention(*x, window, sinks, "sdpa"), q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=0), name


def test_in_bfloat16_to_its_rounding(fake_fa4):
    q, k, v = qkv(5, 90, 4, 2, dtype=torch.bfloat16)
    got = outputs_and_grads(lambda *x: attention.attention(*x, 5, 3, "fa4"), q, k, v)
    want = outputs_and_grads(lambda *x: reference(*x, 5, 3), q.float(), k.float(), v.float())
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert (g - w).abs().max() <= 2 ** -6 * max(w.abs().max().item(), 1.0), name


def test_one_launch_each_way_and_the_first_rows_untouched(fake_fa4, monkeypatch):
    """Rows up to the window see every sink inside it: the kernels start after them."""
    launches: list[str] = []
    for name in ("_attention_sinks_forward_kernel", "_attention_sinks_backward_kernel"):
        count_launches(monkeypatch, attention_sinks, name, launches)
    q, k, v = qkv(9, 40, 2, 1)
    out, *_ = outputs_and_grads(lambda *x: attention.attention(*x, 8, 4, "fa4"), q, k, v)
    assert launches == ["_attention_sinks_forward_kernel", "_attention_sinks_backward_kernel"]
    window_alone = FakeFA4.flash_attn_func(q, k, v, causal=True, window_size=(8, None))[0]
    assert torch.equal(out[:, :9], window_alone[:, :9]) and not torch.allclose(out[:, 9:], window_alone[:, 9:])


def test_the_fa4_ops_stay_in_one_compiled_graph(fake_fa4):
    q, k, v = (x.requires_grad_(True) for x in qkv(7, 24, 4, 2))
    compiled = torch.compile(lambda a, b, c: attention.attention(a, b, c, 5, 3, "fa4"), backend="aot_eager",
                             fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    assert torch.allclose(out.detach(), reference(q.detach(), k.detach(), v.detach(), 5, 3), atol=1e-5)
    assert q.grad is not None and torch.isfinite(q.grad).all()



def model_step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_windowed_layers_handed_copied_key_heads_give_the_same_loss_and_gradients(fake_fa4):
    """`GPT.copy_kv_heads`: FA4's windowed layers (sinks included) take keys and values of as
    many heads as the queries; the model's loss and every gradient stay as they were."""
    from test_model import perturbed_tiny

    ids = torch.randint(0, 1024, (2, 70), generator=torch.Generator().manual_seed(3))
    steps, copied = [], []
    for copy in (False, True):
        model = perturbed_tiny(window_attn_size=12, num_sink_tokens=2).train()
        for block in model.blocks:
            block.attn.backend = "fa4"
        copied.append(model.copy_kv_heads() if copy else [])
        steps.append(model_step(model, ids))
    (loss, grads), (copied_loss, copied_grads) = steps
    assert copied == [[], [1, 3]] and torch.allclose(loss, copied_loss, atol=1e-6)
    assert grads.keys() == copied_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(copied_grads[name], grad, atol=1e-5 * max(grad.abs().max().item(), 1.0)), name


def test_only_fa4s_windowed_layers_of_grouped_heads_take_copies_until_the_backend_is_set_again():
    from test_model import perturbed_tiny

    model = perturbed_tiny()
    assert model.copy_kv_heads() == []  # sdpa's layers
    for block in model.blocks:
        block.attn.backend = "fa4"
    assert model.copy_kv_heads() == [1, 3] and [b.attn.kv_copies for b in model.blocks] == [1, 2, 1, 2]
    model.set_attention_backend("sdpa", torch.device("cpu"))
    assert [b.attn.kv_copies for b in model.blocks] == [1, 1, 1, 1]
    ungrouped = perturbed_tiny(num_kv_heads=4)
    for block in ungrouped.blocks:
        block.attn.backend = "fa4"
    assert ungrouped.copy_kv_heads() == []


@pytest.mark.parametrize("setting, asked", [("auto", True), ("on", True), ("off", False)])
def test_the_setting_asks_the_training_model_for_copies(setting, asked, tiny_data_dir, tmp_path, monkeypatch):
    """Where the layers run no FA4 (a CPU), nothing is copied and the log says so."""
    from test_train import tiny_cfg

    from windowgpt_cli.config import RunConfig
    from windowgpt_cli.model.gpt import GPT
    from windowgpt_cli.train.run import train

    calls = []
    original = GPT.copy_kv_heads
    monkeypatch.setattr(GPT, "copy_kv_heads", lambda model: calls.append(model) or original(model))
    train(tiny_cfg(tiny_data_dir, iterations=1, copy_kv_heads=setting), tmp_path / "run")
    assert len(calls) == int(asked) and "copy_kv_heads:off" in (tmp_path / "run" / "train.log").read_text()
    assert RunConfig.load(tmp_path / "run" / "config.json").train.copy_kv_heads == setting


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and attention.fa4_targets(torch.device("cuda"))),
                    reason="needs a Hopper or Blackwell GPU with flash-attn-4")
def test_on_cuda_the_compiled_record_step_with_copied_key_heads_gives_the_same_loss_and_gradients():
    """`assert_compiled_record_steps_agree`: as it is, and with the windowed layers' key heads
    copied."""
    from conftest import assert_compiled_record_steps_agree

    def copied(model):
        assert model.copy_kv_heads() == [2, 4, 6, 8, 10]

    assert_compiled_record_steps_agree(lambda model: None, copied)
