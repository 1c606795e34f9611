"""XSA and the sparse output gate as one op (`kernels.attention_output`, `train --fused-xsa`):
torch's steps (`TorchOps.attention_output`), forward and gradients, alone, compiled into one
graph, and as the model's training forward (a run with it on: `test_fused_heads.py`). On the
CPU the kernels run in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from windowgpt_cli.model.ops import TORCH_OPS, TorchOps

from conftest import (bf16_training_step, compiled_steps_agree, count_launches, interpret_kernels_without_cuda,
                      training_steps_agree, within as close)
from test_model import perturbed_tiny

interpret_kernels_without_cuda()

from windowgpt_cli.kernels import attention_output  # noqa: E402
from windowgpt_cli.kernels.attention_output import fused_attention_output  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")


def operands(t: int = 21, heads: int = 4, value_heads: int = 2, seed: int = 0):
    """y [2, t, heads, 16], v [2, t, value_heads, 16] (one value shorter than F.normalize's
    floor of 1e-12), a gate [2, t, heads] in (0, 1). 2 x 21 x 2 rows: the last program
    part-filled."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, t, value_heads, 16, generator=g)
    v[0, 3, 1] *= 1e-14
    return (torch.randn(2, t, heads, 16, generator=g), v, torch.sigmoid(torch.randn(2, t, heads, generator=g)))


def with_xsa() -> TorchOps:
    """Training ops whose XSA and output gate are the fused op."""
    ops = TorchOps()
    ops.fused_output = fused_attention_output
    return ops


def output_and_grads(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*inputs)
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("value_heads", [2, 4])  # groups of two query heads a value, or one each
def test_the_op_gives_torchs_steps_and_their_gradients(gated, value_heads):
    y, v, gate = operands(value_heads=value_heads)
    (out, grads), (want, want_grads) = (
        output_and_grads(lambda y, v, g: fn(y, v, g if gated else None) * g.sum(), y, v, gate)
        for fn in (fused_attention_output, TORCH_OPS.attention_output))
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


def test_in_bfloat16_the_op_keeps_the_dtypes_and_stays_within_rounding():
    y, v, gate = operands()
    out, grads = output_and_grads(fused_attention_output, y.bfloat16(), v.bfloat16(), gate.bfloat16())
    want, want_grads = output_and_grads(TORCH_OPS.attention_output, y, v, gate)
    assert out.dtype == torch.bfloat16 and all(grad.dtype == torch.bfloat16 for grad in grads)
    assert close(out, want, 2 ** -6) and all(close(a, b, 2 ** -5) for a, b in zip(grads, want_grads))


def test_heads_the_kernels_cannot_take_are_left_to_torch():
    y, v, gate = operands()
    assert fused_attention_output(y[..., :12], v[..., :12], gate) is None  # 12 channels: not a power of two
    assert fused_attention_output(y[:, :, :3], v, gate[..., :3]) is None  # 3 heads over 2 values
    ops = with_xsa()
    assert torch.equal(ops.attention_output(y[..., :12], v[..., :12], gate),
                       TORCH_OPS.attention_output(y[..., :12], v[..., :12], gate))
    assert torch.equal(ops.attention_output(y, None, gate), y * gate[..., None])  # no XSA: torch's gate alone


def test_inside_a_compiled_function_the_op_stays_one_graph():
    from torch._dynamo.testing import CompileCounter

    y, v, gate = operands()
    ops, counter = with_xsa(), CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda y, v, g: ops.attention_output(y * 2, v, torch.sigmoid(g)), backend=counter,
                             fullgraph=True)
    out, grads = output_and_grads(compiled, y, v, gate)
    want, want_grads = output_and_grads(lambda y, v, g: TORCH_OPS.attention_output(y * 2, v, torch.sigmoid(g)),
                                        y, v, gate)
    assert counter.frame_count == 1
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


@pytest.mark.slow
def test_the_models_training_forward_runs_the_op_on_every_xsa_layer(monkeypatch):
    """A tiny model with XSA and the output gate on every layer, under bf16 autocast: one
    launch each way per layer, the loss and gradients of torch's steps to bfloat16 rounding."""
    launches: list[str] = []
    for name in ("_xsa_forward_kernel", "_xsa_backward_kernel"):
        count_launches(monkeypatch, attention_output, name, launches)
    options = {"xsa_last_n": 4, "attn_out_gate_width": 12, "attn_out_gate_scale": 0.5}
    ids = torch.randint(0, 1024, (2, 25), generator=torch.Generator().manual_seed(5))
    plain, fused = (bf16_training_step(perturbed_tiny(**options), ids[:, :-1], ids[:, 1:], ops)
                    for ops in (None, with_xsa()))
    layers = perturbed_tiny(**options).cfg.num_layers
    assert launches.count("_xsa_forward_kernel") == launches.count("_xsa_backward_kernel") == layers
    training_steps_agree(plain, fused, ("qo_bank", "kv_bank", "blocks.0.attn.attn_gate", "tok_emb.weight"), close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_step_with_the_op_gives_the_same_loss_and_gradients():
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences: within 1e-3 of the compiler's steps', the attention banks' gradients within 2%
    of their size."""
    compiled_steps_agree(None, with_xsa(), lambda model: [model.qo_bank.grad, model.kv_bank.grad])
