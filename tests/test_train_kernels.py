"""The training kernels differentiate the model's own element-wise steps (`TorchOps`).

On the CPU they run in Triton's interpreter (where Triton is installed), in float32, where
they agree with torch's autograd to float32 rounding. On CUDA (tests marked gpu) they run
in bfloat16 at the size test-time training uses.
"""
from __future__ import annotations

import pytest
import torch

from windowgpt_cli.model.ops import TORCH_OPS
from windowgpt_cli.model.rotary import rotary_inv_freq, rotary_tables

from conftest import interpret_kernels_without_cuda
from test_model import perturbed_tiny

interpret_kernels_without_cuda()

from windowgpt_cli.model.fused_train_ops import TrainingOps  # noqa: E402

pytestmark = pytest.mark.usefixtures("interpreter_fixes")
TRAINING = TrainingOps()


def gradients(fn, *inputs: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn's output and the gradients of its inputs under one random upstream gradient."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype))
    return out.detach(), [t.grad for t in inputs]


def agree(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return bool(((a - b).abs().max() <= tol * b.abs().max().clamp(min=1.0)).item())


@pytest.mark.parametrize("rope_dims", [8, 0])  # part of each head rotated, or all of it
@pytest.mark.parametrize("per_sequence", [False, True])  # one table for every sequence, or one each
@pytest.mark.parametrize("t", [5, 37])  # positions of one program, or of several (the last one part-filled)
@pytest.mark.slow
def test_head_prep_forward_and_gradients(rope_dims, per_sequence, t):
    torch.manual_seed(0)
    b, heads, head_dim = 2, 3, 16
    x, gain = torch.randn(b, t, heads, head_dim), torch.rand(heads) + 0.5
    inv_freq = rotary_inv_freq(rope_dims or head_dim, 10000.0, t, t)
    cos, sin = rotary_tables(t, inv_freq)
    if per_sequence:
        cos, sin = (torch.cat([table, table.roll(1, dims=1)]) for table in (cos, sin))
    for fused_fn, torch_fn in [
        (lambda x, g: TRAINING.head_prep(x, cos, sin, rope_dims, g), lambda x, g: TORCH_OPS.head_prep(x, cos, sin,
                                                                                                      rope_dims, g)),
        (lambda x, g: TRAINING.head_prep(x, cos, sin, rope_dims, None) * g.sum(),
         lambda x, g: TORCH_OPS.head_prep(x, cos, sin, rope_dims, None) * g.sum()),
    ]:
        (fused, fused_grads), (reference, reference_grads) = gradients(fused_fn, x, gain), gradients(torch_fn, x, gain)
        assert agree(fused, reference)
        assert all(agree(f, r) for f, r in zip(fused_grads, reference_grads))


@pytest.mark.parametrize("rope_dims", [8, 0])  # part of each head rotated, or all of it
def test_head_kernels_give_the_same_numbers_at_every_launch_shape(rope_dims):
    """Positions per program change only how the rows are split among programs (the last
    one part-filled at 37 positions), and the forward's rotated channels computed apart only
    how its work is divided: the default and the shapes bench/head_kernels_speed.py times give
    the same bits, with each key head stored once and twice (whose gradients the backward
    adds up), with a gain and without, x whole or a slice of a stacked product's heads."""
    from windowgpt_cli.kernels import elementwise, elementwise_backward

    torch.manual_seed(0)
    x, gain = torch.randn(1, 37, 3, 16), torch.rand(3) + 0.5
    stacked = torch.cat([torch.randn(1, 37, 1, 16), x, torch.randn(1, 37, 2, 16)], dim=2)
    cos, sin = elementwise.head_tables(x, *rotary_tables(37, rotary_inv_freq(rope_dims or 16, 10000.0, 37, 37)),
                                       rope_dims)
    launches = (elementwise.HEAD_LAUNCH, elementwise.HeadLaunch(32, 4), elementwise.HeadLaunch(8, 2),
                elementwise.HeadLaunch(32, 8), elementwise.HeadLaunch(16, 4, rotated_apart=True),
                elementwise.HeadLaunch(8, 2, rotated_apart=True))

    def run(launch, x, grad, g, copies, dx=None):
        return (elementwise.head_prep(x, cos, sin, g, torch.float32, launch, copies),
                *elementwise_backward.head_prep_backward(grad, x, cos, sin, g, launch, dx=dx))

    for copies, g in ((1, gain), (2, gain), (2, None)):
        grad = torch.randn(1, 37, 3 * copies, 16)
        want = run(elementwise.HEAD_LAUNCH, x, grad, g, copies)
        assert want[0].shape == (1, 37, 3 * copies, 16) and (want[2] is None) == (g is None)
        for launch in launches:
            dx = torch.zeros_like(stacked)
            for result in (run(launch, x, grad, g, copies),
                           run(launch, stacked[:, :, 1:4], grad, g, copies, dx=dx[:, :, 1:4])):
                assert all(a is b is None or torch.equal(a, b) for a, b in zip(result, want)), launch
            assert not dx[:, :, [0, 4, 5]].any()


def test_leaky_square_forward_and_gradient():
    torch.manual_seed(0)
    h = torch.randn(3, 7, 40)  # a size that no block of the kernel divides
    (fused, (fused_grad,)), (reference, (reference_grad,)) = (gradients(lambda h: ops.leaky_square(h, 0.5), h)
                                                              for ops in (TRAINING, TORCH_OPS))
    assert agree(fused, reference) and agree(fused_grad, reference_grad)


@pytest.mark.slow
def test_a_training_step_through_the_model_agrees_with_torch():
    """The tiny model's loss and every parameter's gradient, with the fused steps and without."""
    x = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(2))
    results = []
    for ops in (TRAINING, TORCH_OPS):
        model = perturbed_tiny().train()
        loss = model(x, x.roll(-1, dims=1), ops=ops)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (fused_loss, fused_grads), (loss, grads) = results
    assert agree(fused_loss, loss) and fused_grads.keys() == grads.keys()
    assert all(agree(fused_grads[n], grads[n], tol=1e-4) for n in grads)


def test_kernel_builds_launch_every_kernel_once():
    model = perturbed_tiny()
    builds = TRAINING.kernel_builds(model, 64)
    assert len(builds) == 4
    for build in builds:
        build()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_prep_and_activation_on_cuda():
    """At test-time training's size (16 sequences of 2048, the default model's heads) in
    bfloat16: outputs and gradients within a few bfloat16 steps of torch's float32 autograd."""
    torch.manual_seed(0)
    x = torch.randn(16, 2048, 8, 64, device="cuda")
    gain = torch.rand(8, device="cuda") + 1.0
    cos, sin = rotary_tables(2048, rotary_inv_freq(16, 10000.0, 2048, 1024, device=torch.device("cuda")))
    for ops_fn in (lambda ops, x, g: ops.head_prep(x, cos, sin, 16, g),
                   lambda ops, x, g: ops.leaky_square(x, 0.5) * g.sum()):
        fused, fused_grads = gradients(lambda x, g: ops_fn(TRAINING, x, g), x.bfloat16(), gain)
        reference, reference_grads = gradients(lambda x, g: ops_fn(TORCH_OPS, x, g), x, gain)
        assert fused.dtype == torch.bfloat16 and agree(fused.float(), reference, tol=2 ** -6)
        assert all(agree(f.float(), r, tol=2 ** -5) for f, r in zip(fused_grads, reference_grads))
