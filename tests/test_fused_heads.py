"""The queries' and keys' per-head norm, rotation and gain as one op (`kernels.fused_heads`,
`train --fused-head-prep`): torch's steps, forward and gradients, alone, compiled into one
graph, and as the model's training forward; the choices of this setting and `--fused-xsa`,
and a run with either on. On the CPU the kernels run in Triton's interpreter."""
from __future__ import annotations

import json

import pytest
import torch

from windowgpt_cli.model.ops import TORCH_OPS, TorchOps
from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_tables

from conftest import (bf16_training_step, compiled_steps_agree, count_launches, interpret_kernels_without_cuda,
                      training_steps_agree, within as close)
from test_model import perturbed_tiny
from test_train import tiny_cfg

interpret_kernels_without_cuda()

from windowgpt_cli.config import RunConfig  # noqa: E402
from windowgpt_cli.kernels import elementwise, elementwise_backward  # noqa: E402
from windowgpt_cli.kernels.fused_heads import fused_head_prep, fused_head_prep_pair  # noqa: E402
from windowgpt_cli.train import trainer  # noqa: E402
from windowgpt_cli.train.run import train  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")
ROPE_DIMS = 8


def heads(t: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries [2, t, 4, 16], a gain per head, and rotary tables over ROPE_DIMS of 16 channels."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = rotary_tables(t, rotary_inv_freq(ROPE_DIMS, 10000.0, t, t))
    return torch.randn(2, t, 4, 16, generator=g), torch.rand(4, generator=g) + 0.5, cos, sin


def with_heads(rotated_apart: bool = False) -> TorchOps:
    """Training ops whose queries' and keys' steps are the fused op (its forward's rotated
    channels apart if asked)."""
    import functools

    ops = TorchOps()
    ops.fused_heads = functools.partial(fused_head_prep, rotated_apart=True) if rotated_apart else fused_head_prep
    return ops


def output_and_grads(fn, x: torch.Tensor, gain: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    inputs = [t.detach().clone().requires_grad_(True) for t in (x, gain)]
    out = fn(*inputs)
    (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
    return out.detach(), [t.grad for t in inputs]


@pytest.mark.parametrize("with_gain", [True, False])  # queries, keys
def test_the_op_gives_torchs_steps_and_their_gradients(with_gain):
    x, gain, cos, sin = heads()
    (out, grads), (want, want_grads) = (
        output_and_grads(lambda x, g: fn(x, cos, sin, ROPE_DIMS, g if with_gain else None) * g.sum(), x, gain)
        for fn in (fused_head_prep, TORCH_OPS.head_prep))
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("copies", [2, 3])
def test_copies_store_each_head_once_per_query_head_of_its_group_and_add_up_their_gradients(copies):
    x, gain, cos, sin = heads()
    (out, grads), (want, want_grads) = (
        output_and_grads(lambda x, g: fn(x, cos, sin, ROPE_DIMS, g, copies) * g.sum(), x, gain)
        for fn in (fused_head_prep, TORCH_OPS.head_prep))
    assert out.shape == (2, 24, 4 * copies, 16)
    once = TORCH_OPS.head_prep(x, cos, sin, ROPE_DIMS, gain)
    assert torch.equal(want, once.repeat_interleave(copies, 2) * gain.sum())
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


def test_a_slice_of_a_stacked_product_is_read_in_place_forward_and_back(monkeypatch):
    _, gain, cos, sin = heads()
    stacked = torch.randn(2, 24, 3 * 64, generator=torch.Generator().manual_seed(3))  # q, k, v: [B, T, 3 * 4 * 16]
    copies = []
    original = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: (
        copies.append(tuple(t.shape)) if not t.is_contiguous() else None) or original(t, *a, **k))

    def queries(fn):
        return lambda s, g: fn(s[..., :64].unflatten(-1, (4, 16)), cos, sin, ROPE_DIMS, g) * g.sum()

    out, grads = output_and_grads(queries(fused_head_prep), stacked, gain)
    assert (2, 24, 4, 16) not in copies  # the kernels read the slice through its strides
    want, want_grads = output_and_grads(queries(TORCH_OPS.head_prep), stacked, gain)
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))
    assert grads[0][..., 64:].abs().max() == 0  # the keys' and values' columns: no gradient from the queries
    assert elementwise.by_positions(want.transpose(0, 1))[0].is_contiguous()  # positions unevenly spaced: copied


@pytest.mark.parametrize("copies", [1, 2])
def test_the_pair_op_gives_both_ops_steps_and_one_gradient_for_the_stacked_slice(copies, monkeypatch):
    """Queries (4 heads) and keys (2) of a stacked product's slice, its values beside them."""
    _, gain, cos, sin = heads()
    stacked = torch.randn(2, 24, 8 * 16, generator=torch.Generator().manual_seed(6))
    launches: list[str] = []
    count_launches(monkeypatch, elementwise_backward, "_head_prep_backward_kernel", launches)

    def pair(fn):
        return lambda s, g: torch.cat(fn(s[..., :96].unflatten(-1, (6, 16)), cos, sin, ROPE_DIMS, g, 4, copies),
                                      2) * g.sum()

    out, grads = output_and_grads(pair(fused_head_prep_pair), stacked, gain)
    assert out.shape == (2, 24, 4 + 2 * copies, 16) and launches == ["_head_prep_backward_kernel"] * 2
    want, want_grads = output_and_grads(pair(TORCH_OPS.head_prep_pair), stacked, gain)
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))
    assert grads[0][..., 96:].abs().max() == 0  # the values' columns
    x = stacked[..., :96].unflatten(-1, (6, 16))
    tables = elementwise.head_tables(x, cos, sin, ROPE_DIMS)
    grad_q, grad_k = torch.randn(2, 24, 4, 16), torch.randn(2, 24, 2 * copies, 16)
    dx, _ = torch.ops.windowgpt.head_prep_pair_backward(grad_q, grad_k, x, *tables, gain, 4)
    assert dx.shape == x.shape and dx.is_contiguous()  # one tensor for the slice: one operand for the product back
    assert torch.equal(dx[:, :, 4:], elementwise_backward.head_prep_backward(grad_k, x[:, :, 4:], *tables, None)[0])


def test_in_bfloat16_the_op_keeps_the_dtype_and_stays_within_rounding():
    x, gain, cos, sin = heads()
    out, (dx, dgain) = output_and_grads(lambda x, g: fused_head_prep(x, cos, sin, ROPE_DIMS, g), x.bfloat16(), gain)
    want, (want_dx, want_dgain) = output_and_grads(lambda x, g: TORCH_OPS.head_prep(x, cos, sin, ROPE_DIMS, g), x, gain)
    assert out.dtype == dx.dtype == torch.bfloat16 and dgain.dtype == torch.float32
    assert close(out, want, 2 ** -6) and close(dx, want_dx, 2 ** -5) and close(dgain, want_dgain, 2 ** -5)


def test_heads_the_kernels_cannot_take_are_left_to_torch():
    x, gain, cos, sin = heads()
    assert fused_head_prep(x[..., :12], cos, sin, ROPE_DIMS, gain) is None  # 12 channels: not a power of two
    ops = with_heads()
    assert torch.equal(ops.head_prep(x[..., :12], cos, sin, ROPE_DIMS, gain),
                       TORCH_OPS.head_prep(x[..., :12], cos, sin, ROPE_DIMS, gain))


def test_inside_a_compiled_function_the_op_stays_one_graph():
    from torch._dynamo.testing import CompileCounter

    x, gain, cos, sin = heads()
    ops, counter = with_heads(), CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, g: ops.head_prep(x * 2, cos, sin, ROPE_DIMS, g), backend=counter,
                             fullgraph=True)
    out, grads = output_and_grads(compiled, x, gain)
    want, want_grads = output_and_grads(lambda x, g: TORCH_OPS.head_prep(x * 2, cos, sin, ROPE_DIMS, g), x, gain)
    assert counter.frame_count == 1
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


def test_inside_a_compiled_function_the_pair_op_stays_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    _, gain, cos, sin = heads()
    x = torch.randn(2, 24, 6, 16, generator=torch.Generator().manual_seed(7))
    ops, counter = with_heads(), CompileCounterWithBackend("aot_eager")
    ops.fused_head_pair = fused_head_prep_pair
    torch._dynamo.reset()

    def pair(ops):
        return lambda x, g: torch.cat(ops.head_prep_pair(x * 2, cos, sin, ROPE_DIMS, g, 4, 2), 2)

    out, grads = output_and_grads(torch.compile(pair(ops), backend=counter, fullgraph=True), x, gain)
    want, want_grads = output_and_grads(pair(TORCH_OPS), x, gain)
    assert counter.frame_count == 1
    assert close(out, want, 1e-5) and all(close(a, b, 1e-5) for a, b in zip(grads, want_grads))


@pytest.mark.slow
def test_the_models_training_forward_runs_the_op_for_every_query_and_key(monkeypatch):
    """The tiny model's training loss under bf16 autocast with the op set: one launch each
    way for the queries and the keys of every block, the loss and gradients of torch's steps
    to bfloat16 rounding."""
    launches: list[str] = []
    count_launches(monkeypatch, elementwise, "_head_prep_kernel", launches)
    count_launches(monkeypatch, elementwise_backward, "_head_prep_backward_kernel", launches)
    ids = torch.randint(0, 1024, (2, 25), generator=torch.Generator().manual_seed(5))
    plain, fused = (bf16_training_step(perturbed_tiny(), ids[:, :-1], ids[:, 1:], ops) for ops in (None, with_heads()))
    layers = perturbed_tiny().cfg.num_layers
    assert launches.count("_head_prep_kernel") == launches.count("_head_prep_backward_kernel") == 2 * layers
    training_steps_agree(plain, fused, ("qo_bank", "kv_bank", "blocks.0.attn.q_gain", "tok_emb.weight"), close)


def test_auto_is_on_for_a_cuda_device_where_triton_runs(monkeypatch):
    """Both fused ops' settings (`fused_head_prep`, `fused_xsa`) resolve alike."""
    cfg = RunConfig()
    assert cfg.train.fused_head_prep == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(trainer, "triton_available", lambda device: device.type == "cuda")
    assert cfg.train.fused_xsa == "auto"
    for setting, on_cpu, on_cuda in (("off", False, False), ("auto", False, True), ("on", False, True)):
        assert (trainer.fused_op_on(setting, cpu), trainer.fused_op_on(setting, cuda)) == (on_cpu, on_cuda)
    monkeypatch.setattr(trainer, "triton_available", lambda device: False)  # CUDA without Triton
    assert not trainer.fused_op_on("on", cuda)


@pytest.mark.parametrize("setting, module, op, calls_per_forward, values", [
    ("fused_head_prep", "fused_heads", "fused_head_prep", lambda model: 2 * model.num_layers,  # queries, keys
     ("off", "on", "apart")),
    ("fused_xsa", "attention_output", "fused_attention_output", lambda model: model.xsa_last_n, ("off", "on")),
])
def test_a_run_with_a_fused_op_on_passes_through_it(setting, module, op, calls_per_forward, values, tiny_data_dir,
                                                      tmp_path, monkeypatch):
    """The setting reaches the training step (the op stood in for by one that counts its
    calls and leaves the tensors to torch: the interpreter's kernels would take minutes a
    step), and the log, summary and configuration say which ran; apart (the heads') is the
    op with its forward's rotated channels apart."""
    import importlib

    monkeypatch.setattr(trainer, "triton_available", lambda device: True)
    calls = dict.fromkeys(values, 0)
    apart_asked = []
    for value in calls:
        def counting(*args, value=value, **kwargs):
            calls[value] += 1
            apart_asked.append((value, kwargs.get("rotated_apart", False)))

        monkeypatch.setattr(importlib.import_module(f"windowgpt_cli.kernels.{module}"), op, counting)
        cfg = tiny_cfg(tiny_data_dir, iterations=2, train_batch_tokens=2048, **{setting: value})
        train(cfg, tmp_path / value)
        assert f"{setting}:{value}" in (tmp_path / value / "train.log").read_text()
        kernels = json.loads((tmp_path / value / "summary.json").read_text())["kernels"]
        assert kernels[setting] == value and {kernels["fused_head_prep"], kernels["fused_xsa"]} <= {value, "off"}
        assert getattr(RunConfig.load(tmp_path / value / "config.json").train, setting) == value
    # in each training forward (2 micro-batches a step; validation adds more)
    assert calls["off"] == 0 and all(calls[value] >= calls_per_forward(cfg.model) * 2 * 2 for value in values[1:])
    assert {asked for value, asked in apart_asked if value == "on"} == {False}
    assert {asked for value, asked in apart_asked if value == "apart"} == ({True} if "apart" in values else set())


def test_with_the_rotated_channels_apart_the_op_gives_the_same_numbers_in_one_graph():
    """`rotated_apart` (the forward's rotated channels in a block of their own): the op's
    output and gradients equal the op's without it, the pair op's too, each compiled into one
    graph as the training step calls them (through functools.partial)."""
    import functools

    from torch._dynamo.testing import CompileCounterWithBackend

    x, gain, cos, sin = heads()
    stacked = torch.randn(2, 24, 6, 16, generator=torch.Generator().manual_seed(7))
    for op, x, call in ((fused_head_prep, x, lambda op, x, g: op(x * 2, cos, sin, ROPE_DIMS, g)),
                        (fused_head_prep_pair, stacked, lambda op, x, g: torch.cat(op(x * 2, cos, sin, ROPE_DIMS, g,
                                                                                      4, 2), 2))):
        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        apart = torch.compile(functools.partial(call, functools.partial(op, rotated_apart=True)), backend=counter,
                              fullgraph=True)
        out, grads = output_and_grads(apart, x, gain)
        want, want_grads = output_and_grads(functools.partial(call, op), x, gain)
        assert counter.frame_count == 1
        assert torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rotated_apart", [False, True])
def test_on_cuda_the_compiled_step_with_the_op_gives_the_same_loss_and_gradients(rotated_apart):
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences: within 1e-3 of the compiler's steps', the attention banks' and the gains'
    gradients within 2% of their size; with the forward's rotated channels apart too."""
    compiled_steps_agree(None, with_heads(rotated_apart),
                         lambda model: [model.qo_bank.grad, model.kv_bank.grad, model.blocks[0].attn.q_gain.grad])
