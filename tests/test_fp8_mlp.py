"""The float8 MLP's Triton kernels (`kernels.fp8_mlp`, `train --fp8-mlp` with `fp8_mlp_kernels`):
LeakyReLU² and its derivative with their rows rounded to float8 exactly as
`fp8_products.to_fp8_rows` rounds them, and the MLP through them equal to the MLP of float8
products one at a time, forward and gradients. Without CUDA the kernels run in Triton's
interpreter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import interpret_kernels_without_cuda

interpret_kernels_without_cuda()

from test_model import perturbed_tiny  # noqa: E402
from windowgpt_cli.kernels import fp8_mlp  # noqa: E402
from windowgpt_cli.kernels.fp8_mlp import (  # noqa: E402
    RowLaunch,
    fp8_leaky_square_mlp,
    leaky_square_fp8,
    leaky_square_fp8_backward,
    leaky_square_fp8_backward_rows,
    leaky_square_fp8_rows,
)
from windowgpt_cli.kernels.fp8_products import fp8_available, fp8_linear, to_fp8_rows  # noqa: E402
from windowgpt_cli.model.fp8_ops import Fp8Ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
float8_products = pytest.mark.skipif(not fp8_available(DEVICE), reason="this torch has no float8 products here")
SLOPE = 0.5


def spread_rows(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows whose magnitudes differ by up to 2^20 (their scales differ), one row zero."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-12, 8, (rows, 1), generator=g).float())
    h[3] = 0
    return h.to(DEVICE, dtype)


def assert_rounded_as_torch(values: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    want_codes, want_scale = to_fp8_rows(values)
    assert codes.dtype == want_codes.dtype and torch.equal(scale, want_scale)
    assert torch.equal(codes.float(), want_codes.float())


# 37 rows (not a whole number of programs' rows), 96 columns (not a power of two)
@pytest.mark.parametrize("rows, cols", [(37, 96), (5, 1536)])
def test_the_activation_and_its_codes_are_torchs(rows, cols):
    h = spread_rows(rows, cols, torch.float32)
    a, codes, scale = leaky_square_fp8(h, SLOPE)
    assert torch.equal(a, F.leaky_relu(h, SLOPE).square())
    assert_rounded_as_torch(a, codes, scale)


def test_the_derivative_and_its_codes_are_torchs():
    h = spread_rows(37, 96, torch.float32).requires_grad_()
    grad = spread_rows(37, 96, torch.float32, seed=1)
    dh, codes, scale = leaky_square_fp8_backward(grad, h.detach(), SLOPE)
    F.leaky_relu(h, SLOPE).square().backward(grad)
    assert torch.allclose(dh, h.grad, rtol=1e-6, atol=0)
    assert_rounded_as_torch(dh, codes, scale)


def test_codes_round_to_nearest_even_across_binades_and_below_the_normal_range():
    """With h = 0.5 the derivative is the gradient itself, so the gradient's row is what is
    rounded: a largest magnitude of 448 (scale 1), values just under powers of two (rounding up
    into the next binade), ties between codes, and values under 2^-6 (float8's subnormals)."""
    row = [448.0, 31.6693, -126.9046, 447.9, 17.0, 19.0, -0.0146, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -12, 0.0, 1e-30]
    grad = torch.tensor([row, [-v / 1024 for v in row]], device=DEVICE)
    dh, codes, scale = leaky_square_fp8_backward(grad, torch.full_like(grad, 0.5), SLOPE)
    assert torch.equal(dh, grad)
    assert_rounded_as_torch(grad, codes, scale)
    assert codes[0, :7].float().tolist() == [448.0, 32.0, -128.0, 448.0, 16.0, 20.0, -7 * 2.0 ** -9]


# 7 rows of 128 lanes: one a program (fewer lanes than a row's), two, and four (the last
# program's partly empty), where the default's one program holds them all
@pytest.mark.parametrize("launch", [RowLaunch(64, 2), RowLaunch(256, 4), RowLaunch(512, 16)])
def test_every_cut_of_the_rows_gives_the_same_results(launch):
    h, grad = spread_rows(7, 96, torch.float32), spread_rows(7, 96, torch.float32, seed=1)
    for default, cut in ((leaky_square_fp8(h, SLOPE), leaky_square_fp8_rows(h, SLOPE, launch)),
                         (leaky_square_fp8_backward(grad, h, SLOPE),
                          leaky_square_fp8_backward_rows(grad, h, SLOPE, launch))):
        assert launch.grid_and_options(h)[0] != RowLaunch().grid_and_options(h)[0]
        for want, got in zip(default, cut):
            assert torch.equal(got.float(), want.float())


def test_in_bfloat16_the_codes_are_those_of_the_stored_activation():
    h = spread_rows(37, 96, torch.bfloat16)
    a, codes, scale = leaky_square_fp8(h, SLOPE)
    want = F.leaky_relu(h.float(), SLOPE).square()
    # within one bfloat16 step of torch's (the interpreter truncates where the GPU rounds)
    assert a.dtype == torch.bfloat16 and torch.allclose(a.float(), want, rtol=2 ** -7, atol=0)
    assert_rounded_as_torch(a, codes, scale)


@float8_products
def test_the_mlp_through_the_kernels_equals_its_products_one_at_a_time():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 24, 64, generator=g).to(DEVICE).requires_grad_()
    up = (torch.randn(192, 64, generator=g) / 8).to(DEVICE).requires_grad_()
    down = (torch.randn(64, 192, generator=g) / 14).to(DEVICE).requires_grad_()
    grad_out = torch.randn(2, 24, 64, generator=g).to(DEVICE)

    def run(mlp):
        out = mlp()
        out.backward(grad_out)
        grads = [t.grad for t in (x, up, down)]
        x.grad = up.grad = down.grad = None
        return out.detach(), grads

    fused, fused_grads = run(lambda: fp8_leaky_square_mlp(x, up, down, SLOPE))
    plain, plain_grads = run(lambda: fp8_linear(F.leaky_relu(fp8_linear(x, up), SLOPE).square(), down))
    assert torch.equal(fused, plain)
    for got, want in zip(fused_grads, plain_grads):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_operands_the_kernels_do_not_take_are_refused():
    with pytest.raises(ValueError, match="as fp8_fits asks"):
        fp8_leaky_square_mlp(torch.zeros(4, 32), torch.zeros(40, 32), torch.zeros(32, 40), SLOPE)


@float8_products
def test_fp8_ops_run_the_training_mlp_through_the_kernels(monkeypatch):
    x = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(7))
    plain_model, kernel_model = perturbed_tiny().train(), perturbed_tiny().train()
    plain_model.train_ops = Fp8Ops(("mlp",))
    kernel_model.train_ops = Fp8Ops(("mlp",), mlp_kernels=True)
    calls = []
    monkeypatch.setattr(fp8_mlp, "fp8_leaky_square_mlp",
                        lambda *args, mlp=fp8_mlp.fp8_leaky_square_mlp: calls.append(1) or mlp(*args))
    plain, kernel = plain_model(x, y), kernel_model(x, y)
    assert len(calls) == plain_model.cfg.num_layers and torch.equal(plain, kernel)
    plain.backward()
    kernel.backward()
    for (name, p), q in zip(plain_model.named_parameters(), kernel_model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    with torch.no_grad():  # without gradients: no kernels, bfloat16's (here float32's) products
        kernel_model(x, y)
    assert len(calls) == plain_model.cfg.num_layers


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_available(torch.device("cuda"))),
                    reason="needs a CUDA GPU with float8 products")
def test_on_cuda_the_compiled_step_with_the_kernels_is_the_compilers():
    """The full-size model's compiled training loss in bf16 autocast, the MLP in float8, with
    and without the kernels (one graph either way): the same loss to 1e-3, every bank's
    gradient pointing the same way (cosine over 0.999)."""
    from conftest import bank_grads, compiled_step_on_cuda

    def variant(kernels: bool):
        def set_up(model):
            model.train_ops = Fp8Ops(("mlp",), mlp_kernels=kernels)
        return set_up

    (plain, plain_grads), (kernel, kernel_grads) = compiled_step_on_cuda([variant(False), variant(True)], bank_grads)
    assert plain_grads and abs(plain - kernel) < 1e-3 * plain
    for plain_grad, kernel_grad in zip(plain_grads, kernel_grads):
        assert plain_grad.abs().amax() > 0
        assert F.cosine_similarity(plain_grad.flatten(), kernel_grad.flatten(), dim=0) > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_available(torch.device("cuda"))),
                    reason="needs a CUDA GPU with float8 products")
def test_on_cuda_train_with_fp8_mlp_runs_the_kernels_inside_the_compiled_step(tiny_data_dir, tmp_path, monkeypatch):
    """`train --fp8-mlp` on CUDA, compiled: the activation's kernels run inside the compiled
    step, no graph compiled after the warm-up, and the run ends where the compiler's kernels
    end it (`--no-fp8-mlp-kernels`, which runs none of them), to float8's rounding."""
    import json

    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    calls = []
    monkeypatch.setattr(fp8_mlp, "leaky_square_fp8_rows",
                        lambda *args, forward=fp8_mlp.leaky_square_fp8_rows: calls.append(1) or forward(*args))
    val_losses = {}
    for name, flags in (("kernels", []), ("compiler", ["--no-fp8-mlp-kernels"])):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(out),
                                          "--device", "cuda", "--compile", "--fp8-mlp", *flags, "--iterations", "6"])
        assert result.exit_code == 0, result.output
        assert "compile:graphs_after_warmup:0" in (out / "train.log").read_text()
        val_losses[name] = json.loads((out / "summary.json").read_text())["val_loss"]
        if name == "kernels":
            assert calls, "the compiled step never ran the activation's kernels"
            kernel_calls = len(calls)
    assert len(calls) == kernel_calls  # --no-fp8-mlp-kernels: the compiler's kernels alone
    assert val_losses["kernels"] == pytest.approx(val_losses["compiler"], rel=1e-2)
