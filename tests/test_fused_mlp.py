"""The training step's fused MLP (`kernels.fused_mlp`, `train --fused-mlp`): LeakyReLU² in
the up product's epilogue and its derivative in the epilogue of the product that brings the
gradient back through the down projection give torch's MLP, forward and gradients, to
bfloat16 rounding; alone, compiled, and as the model's training forward. On the CPU the
kernels run in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import bf16_training_step, compiled_steps_agree, interpret_kernels_without_cuda, training_steps_agree
from test_model import perturbed_tiny

interpret_kernels_without_cuda()

from windowgpt_cli.kernels import elementwise  # noqa: E402
from windowgpt_cli.kernels import elementwise_backward as backward  # noqa: E402
from windowgpt_cli.kernels.fused_mlp import leaky_square_mlp, mlp_fits  # noqa: E402
from windowgpt_cli.model.fused_train_ops import ProductEpilogueOps  # noqa: E402
from windowgpt_cli.model.ops import TORCH_OPS  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")
SMALL = elementwise.MatmulTiles(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
SLOPE = 0.5


def close(got: torch.Tensor, want: torch.Tensor, steps: float = 2 ** -6) -> bool:
    """Within `steps` (relative to the largest value) of each other: two bfloat16 steps."""
    scale = want.float().abs().max().clamp(min=1e-6)
    return bool(((got.float() - want.float()).abs().max() <= steps * scale).item())


def operands(rows: int = 37, dim: int = 48, hidden: int = 64, seed: int = 0):
    """bf16 x [rows, dim], up_w [hidden, dim], down_w [dim, hidden]; 37 rows: a part tile."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, dim, generator=g).bfloat16(), (0.3 * torch.randn(hidden, dim, generator=g)).bfloat16(),
            (0.3 * torch.randn(dim, hidden, generator=g)).bfloat16())


def torch_mlp(x: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """The unfused MLP in float32 from the same bf16 values."""
    return F.linear(TORCH_OPS.leaky_square(F.linear(x.float(), up_w.float()), SLOPE), down_w.float())


def output_and_grads(fn, x, up_w, down_w):
    inputs = [t.detach().clone().requires_grad_(True) for t in (x, up_w, down_w)]
    out = fn(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out.float() * weights).sum().backward()
    return out.detach(), [t.grad for t in inputs]


def test_the_up_product_keeps_its_product_beside_the_activation():
    x, up_w, _ = operands()
    hidden, product = elementwise.leaky_square_matmul_with_product(x, up_w, SLOPE, SMALL)
    want = F.linear(x.float(), up_w.float()).bfloat16()
    assert close(product, want) and product.dtype == hidden.dtype == torch.bfloat16
    assert close(hidden, TORCH_OPS.leaky_square(product.float(), SLOPE))


def test_the_gradient_product_applies_the_activations_derivative():
    x, up_w, down_w = operands()
    product = F.linear(x.float(), up_w.float()).bfloat16()
    grad = torch.randn(x.size(0), down_w.size(0), generator=torch.Generator().manual_seed(1)).bfloat16()
    got = backward.leaky_square_grad_matmul(grad, down_w, product, SLOPE, SMALL)
    # the gradient at the product, by autograd through the activation
    h = product.float().requires_grad_(True)
    TORCH_OPS.leaky_square(h, SLOPE).backward((grad.float() @ down_w.float()).bfloat16().float())
    assert (product < 0).any() and (product > 0).any()  # both sides of the activation's bend
    assert close(got, h.grad)


def test_the_op_gives_torchs_output_and_gradients():
    x, up_w, down_w = operands()
    out, grads = output_and_grads(lambda *t: leaky_square_mlp(*t, SLOPE, SMALL), x, up_w, down_w)
    want, want_grads = output_and_grads(torch_mlp, x, up_w, down_w)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape and close(out, want)
    for name, got, expected in zip(("x", "up_w", "down_w"), grads, want_grads):
        assert got.shape == expected.shape and close(got, expected, 2 ** -5), name


def test_inside_a_compiled_function_the_op_stays_one_graph():
    from torch._dynamo.testing import CompileCounter

    x, up_w, down_w = operands(rows=20)
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, u, d: leaky_square_mlp(a * 2, u, d, SLOPE, SMALL), backend=counter,
                             fullgraph=True)
    out, grads = output_and_grads(compiled, x, up_w, down_w)
    want, want_grads = output_and_grads(lambda a, u, d: torch_mlp(a * 2, u, d), x, up_w, down_w)
    assert counter.frame_count == 1 and close(out, want)
    assert all(close(got, expected, 2 ** -5) for got, expected in zip(grads, want_grads))


def test_the_ops_mlp_under_autocast_compiles_into_one_graph():
    """`ProductEpilogueOps.mlp` as the compiled training step calls it: float32 operands that
    autocast casts to bf16, one graph, the fused op's output."""
    from torch._dynamo.testing import CompileCounter

    x, up_w, down_w = (t.float() for t in operands(rows=20))
    ops, counter = ProductEpilogueOps(SMALL), CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, u, d: ops.mlp(a, u, d, SLOPE), backend=counter, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, up_w, down_w)
    assert counter.frame_count == 1 and out.dtype == torch.bfloat16
    assert close(out, leaky_square_mlp(x.bfloat16(), up_w.bfloat16(), down_w.bfloat16(), SLOPE, SMALL), 0)


def test_operands_outside_the_tiles_run_torchs_mlp():
    x, up_w, down_w = operands(hidden=40)  # 40 columns: no whole tiles
    assert not mlp_fits(x, up_w, down_w, SMALL)
    assert not mlp_fits(x.float(), up_w.float(), down_w.float(), SMALL)
    ops = ProductEpilogueOps(SMALL)
    assert close(ops.mlp(x, up_w, down_w, SLOPE), torch_mlp(x, up_w, down_w))


def test_the_models_training_forward_runs_the_fused_mlp(monkeypatch):
    """The tiny model's training loss under bf16 autocast with train_ops set: the fused
    products run (in every block) and give the same loss and gradients as torch's steps."""
    launches = {"up": 0, "grad": 0}
    for name, module, kernel in (("up", elementwise, "_leaky_square_matmul_kernel"),
                                 ("grad", backward, "_leaky_square_grad_matmul_kernel")):
        original = getattr(module, kernel)

        class Counted:
            def __getitem__(self, grid, original=original, name=name):
                launches[name] += 1
                return original[grid]

        monkeypatch.setattr(module, kernel, Counted())
    x = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(6))
    plain, fused = (bf16_training_step(perturbed_tiny(), x, y, ops) for ops in (None, ProductEpilogueOps(SMALL)))
    layers = perturbed_tiny().cfg.num_layers
    assert launches == {"up": layers, "grad": layers}
    training_steps_agree(plain, fused, ("mlp_up_bank", "mlp_down_bank", "qo_bank", "tok_emb.weight"), close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_step_with_the_fused_mlp_gives_the_same_loss_and_gradients():
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences, with the default tiles: the loss within 1e-3 of the compiler's steps', the MLP
    banks' gradients within 2% of their size."""
    compiled_steps_agree(None, ProductEpilogueOps(), lambda model: [model.mlp_up_bank.grad, model.mlp_down_bank.grad])
