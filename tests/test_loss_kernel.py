"""The soft-capped cross-entropy kernels (`kernels.cross_entropy`, `train --fused-cross-entropy`)
against torch's soft cap and cross-entropy: losses and gradients, alone, compiled, and as
the model's training loss. On the CPU they run in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import compiled_step_on_cuda, interpret_kernels_without_cuda
from test_model import perturbed_tiny

interpret_kernels_without_cuda()

from windowgpt_cli.kernels.cross_entropy import head_softcap_cross_entropy, softcap_cross_entropy  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")
CAP = 30.0


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(CAP * torch.tanh(logits.float() / CAP), targets, reduction="none")


def losses_and_grads(fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().clone().requires_grad_(True)
    loss = fn(logits, targets)
    weights = torch.randn(loss.shape, generator=torch.Generator().manual_seed(2))
    (loss * weights).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("vocab", [1000, 1024, 2500])  # one block (partly filled), exactly one, several
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_give_torchs_losses_and_gradients(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (40 * torch.randn(23, vocab, generator=g)).to(dtype)  # large enough that the cap bends them
    targets = torch.randint(0, vocab, (23,), generator=g)
    loss, grad = losses_and_grads(lambda x, t: softcap_cross_entropy(x, t, CAP), logits, targets)
    want_loss, want_grad = losses_and_grads(torch_loss, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    # torch's gradient is rounded to dtype after its own float32 steps; the kernel's once
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bfloat16: one step at the largest gradient
    assert (grad.float() - want_grad.float()).abs().max() <= tol * want_grad.float().abs().max()


def test_rows_with_an_ignored_target_add_no_loss_and_no_gradient():
    """Targets of -100 (the rows that pad a batch) as F.cross_entropy's ignore_index: loss 0,
    gradient 0, the other rows as before; no read outside the logits."""
    g = torch.Generator().manual_seed(8)
    logits = 40 * torch.randn(11, 1500, generator=g)
    targets = torch.randint(0, 1500, (11,), generator=g)
    targets[[0, 4, 10]] = -100
    loss, grad = losses_and_grads(lambda x, t: softcap_cross_entropy(x, t, CAP), logits, targets)
    want_loss, want_grad = losses_and_grads(torch_loss, logits, targets)
    assert torch.equal(loss[[0, 4, 10]], torch.zeros(3)) and torch.equal(grad[[0, 4, 10]], torch.zeros(3, 1500))
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 100])  # a row, chunks not dividing the rows, one, all at once
def test_the_output_layer_with_the_loss_in_chunks_gives_torchs_sum_and_gradients(chunk_rows):
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(16, 24, generator=g)
    weight = 3 * torch.randn(1100, 24, generator=g)  # logits large enough that the cap bends them
    targets = torch.randint(0, 1100, (16,), generator=g)
    targets[[3, 15]] = -100
    results = []
    for fn in (lambda h, w: head_softcap_cross_entropy(h, w, targets, CAP, chunk_rows),
               lambda h, w: torch_loss(h @ w.t(), targets).sum()):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        total = fn(h, w)
        (2.5 * total).backward()  # a factor from outside, as a mean brings
        results.append((total.detach(), h.grad, w.grad))
    (total, grad_h, grad_w), (want, want_h, want_w) = results
    assert total.dtype == torch.float32 and total.shape == ()
    assert torch.allclose(total, want, rtol=1e-5)
    assert torch.allclose(grad_h, want_h, atol=1e-5) and torch.allclose(grad_w, want_w, atol=1e-5)
    assert torch.equal(grad_h[[3, 15]], torch.zeros(2, 24))  # ignored rows get no gradient


def test_the_chunked_op_traces_through_aot_autograd():
    """Compiled through AOTAutograd (its fake shapes, its gradient rule, a factor after it):
    the same sum and gradients as torch's, in one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(10)
    hidden, weight = torch.randn(20, 16, generator=g), torch.randn(300, 16, generator=g)
    targets = torch.randint(0, 300, (20,), generator=g)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, w: head_softcap_cross_entropy(torch.tanh(h), w, targets, CAP, 7) / 20,
                             backend=counter, fullgraph=True)
    results = []
    for fn in (compiled, lambda h, w: torch_loss(torch.tanh(h) @ w.t(), targets).sum() / 20):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (loss, grad_h, grad_w), (want, want_h, want_w) = results
    assert counter.frame_count == 1 and torch.allclose(loss, want, rtol=1e-5)
    assert torch.allclose(grad_h, want_h, atol=1e-6) and torch.allclose(grad_w, want_w, atol=1e-6)


def test_the_chunked_op_refuses_misshapen_inputs():
    with pytest.raises(ValueError, match=r"hidden \[N, D\], weight \[V, D\] and targets \[N\]"):
        head_softcap_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 6), torch.zeros(4, dtype=torch.long), CAP, 2)
    with pytest.raises(ValueError, match="chunk_rows must be at least 1"):
        head_softcap_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 8), torch.zeros(4, dtype=torch.long), CAP, 0)


def test_inside_a_compiled_function_the_op_stays_one_graph():
    from torch._dynamo.testing import CompileCounter

    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(4))
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, t: softcap_cross_entropy(x * 2.0, t, CAP).mean(), backend=counter,
                             fullgraph=True)
    got, grad = losses_and_grads(compiled, logits, targets)
    want, want_grad = losses_and_grads(lambda x, t: torch_loss(x * 2.0, t).mean(), logits, targets)
    assert counter.frame_count == 1 and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-6)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("chunk_rows", [0, 30])  # the logits whole; the output layer with the loss in chunks
def test_the_models_fused_loss_trains_as_its_torch_loss(padded, chunk_rows):
    """The model's training loss with fused_loss (and loss_chunk_rows), compiled whole (one
    graph), against its torch loss: the same loss and the same gradient for every parameter;
    with a row of ignored targets (padded), the mean over the others, as F.cross_entropy's."""
    from torch._dynamo.testing import CompileCounter

    x = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(6))
    if padded:
        y[1] = -100
    counter = CompileCounter()
    torch._dynamo.reset()
    results = []
    for fused in (False, True):
        model = perturbed_tiny().train()
        model.fused_loss, model.loss_chunk_rows = fused, chunk_rows
        loss = (torch.compile(model, backend=counter, fullgraph=True) if fused else model)(x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert counter.frame_count == 1
    assert torch.allclose(plain, fused, atol=1e-5) and plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.allclose(fused_grads[name], grad, atol=1e-6, rtol=1e-4), name


def test_a_training_graph_with_the_fused_loss_validates_as_one_without(eval_model, eval_val_tokens, eval_luts):
    """Validation through the training forward pads its last batch with ignored targets:
    with the fused loss it scores what the torch loss scores."""
    from windowgpt_cli.eval.scoring import evaluate_standard

    val = eval_val_tokens[: ((eval_val_tokens.numel() - 1) // 128) * 128 + 1]
    results = []
    for fused in (False, True):
        eval_model.fused_loss = fused
        results.append(evaluate_standard(eval_model, val, eval_luts, seq_len=128, batch_tokens=3 * 128,
                                         device=torch.device("cpu"), training_graph=True))
    plain, fused = results
    assert (val.numel() - 1) // 128 % 3 != 0  # the last batch is padded
    assert fused.tokens == plain.tokens and fused.val_bpb == pytest.approx(plain.val_bpb, rel=1e-5)


def test_the_op_refuses_misshapen_inputs():
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        softcap_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, dtype=torch.long), CAP)


@pytest.mark.parametrize("flags,setting", [(["--fused-cross-entropy"], "fused_cross_entropy"),
                                           (["--loss-chunk-rows", "512"], "loss_chunk_rows"),
                                           (["--fused-mlp", "triton"], "fused_mlp")])
def test_training_says_a_fused_kernel_is_off_where_it_cannot_run(tiny_data_dir, tmp_path, flags, setting):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out",
                                      str(tmp_path / "run"), "--iterations", "2", *flags])
    assert result.exit_code == 0, result.output
    log = (tmp_path / "run" / "train.log").read_text()
    assert (f"{setting}: off on this device" in log) == (not torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_step_with_the_fused_loss_gives_the_same_loss_and_gradients():
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences: the fused kernels' loss, alone and with the output layer over chunks of 4,096
    rows, within 1e-3 of Inductor's, the output layer's gradient within 1% of its size."""
    def variant(fused: bool, chunk_rows: int):
        def set_up(model):
            model.fused_loss, model.loss_chunk_rows = fused, chunk_rows
        return set_up

    (plain, [plain_grad]), *fused = compiled_step_on_cuda(
        [variant(False, 0), variant(True, 0), variant(True, 4096)], lambda model: [model.tok_emb.weight.grad])
    for fused_loss, [fused_grad] in fused:
        assert abs(plain - fused_loss) < 1e-3
        assert (fused_grad - plain_grad).abs().max() <= 0.01 * plain_grad.abs().max()
