"""The training step's products in float8 (`kernels.fp8_products`, `model.fp8_ops`, `train
--fp8-mlp` and `--fp8-attention`): exact where the operands are float8 numbers, close to
bfloat16's elsewhere, one graph under torch.compile, and training with them on the CPU, whose
torch has float8 products too."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from test_model import perturbed_tiny
from windowgpt_cli.kernels.fp8_products import fp8_available, fp8_linear, fp8_product, to_fp8_rows
from windowgpt_cli.model.fp8_ops import Fp8Ops

CPU = torch.device("cpu")
# Tests that multiply in float8 on the CPU skip where it has no such products; the GPU test
# needs only CUDA's.
cpu_float8 = pytest.mark.skipif(not fp8_available(CPU), reason="this torch has no float8 products on the CPU")


def float8_numbers(*shape: int, seed: int) -> torch.Tensor:
    """Values float8 holds exactly at any power-of-two scale: 0 and +-2^k, with a larger
    magnitude in some rows (their scale differs)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-3, 4, shape, generator=g).float()
    x = values.sign() * torch.exp2(values.abs() - 1) * (values != 0)
    return x * torch.exp2(torch.randint(0, 12, (shape[0], 1), generator=g).float())


@cpu_float8
def test_rows_are_scaled_by_powers_of_two_within_float8s_range():
    x = torch.tensor([[3.0, -1000.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3]])
    codes, scale = to_fp8_rows(x)
    assert torch.equal(torch.log2(scale).round(), torch.log2(scale))
    assert codes.float().abs().amax() <= 448 and (codes.float().abs().amax(dim=1) > 224)[[0, 2]].all()
    assert torch.equal(codes[1].float(), torch.zeros(3))
    assert torch.allclose(codes.float() * scale, x, rtol=1 / 16)


@cpu_float8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_float8_numbers_the_product_and_its_gradients_are_exact(dtype):
    x = float8_numbers(24, 32, seed=1).to(dtype).requires_grad_(True)
    weight = float8_numbers(48, 32, seed=2).to(dtype).requires_grad_(True)
    grad = float8_numbers(24, 48, seed=3).to(dtype) / 1024
    y = fp8_linear(x, weight)
    y.backward(grad)
    x64, weight64, grad64 = x.detach().double(), weight.detach().double(), grad.double()
    assert y.dtype == dtype
    assert torch.equal(y, x64.mm(weight64.t()).to(dtype))
    assert torch.equal(x.grad, grad64.mm(weight64).to(dtype))
    assert torch.allclose(weight.grad.double(), grad64.t().mm(x64), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact).norm() / exact.norm()).item()


@cpu_float8
def test_elsewhere_the_products_round_as_float8_does_but_the_weights_gradient_does_not():
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(64, 128, generator=g).requires_grad_(True), torch.randn(96, 128, generator=g)
    weight.requires_grad_(True)
    grad = torch.randn(64, 96, generator=g)
    y = fp8_linear(x, weight)
    y.backward(grad)
    x64, weight64, grad64 = x.detach().double(), weight.detach().double(), grad.double()
    assert 1e-3 < relative_error(y, x64.mm(weight64.t())) < 0.06  # e4m3: relative steps of 1/16 at most
    assert 1e-3 < relative_error(x.grad, grad64.mm(weight64)) < 0.06
    assert relative_error(weight.grad, grad64.t().mm(x64)) < 1e-6
    assert torch.equal(fp8_product(x.detach(), weight.detach(), fast_accumulation=True), y.detach())


def test_a_misaligned_or_mixed_product_is_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.zeros(4, 32), torch.zeros(40, 32))
    with pytest.raises(ValueError, match="one float dtype"):
        fp8_linear(torch.zeros(4, 32), torch.zeros(32, 32, dtype=torch.bfloat16))


@cpu_float8
def test_compiled_it_is_one_graph_with_the_eager_gradients():
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(2, 40, 64, generator=g), torch.randn(32, 64, generator=g)
    results = []
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    for compile_it in (False, True):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        fn = torch.compile(fp8_linear, backend=counter, fullgraph=True) if compile_it else fp8_linear
        (fn(x, w) ** 2).sum().backward()
        results.append((x.grad, w.grad))
    assert counter.frame_count == 1
    assert all(torch.allclose(c, e, rtol=1e-5, atol=1e-4) for c, e in zip(*results))


def loss_and_grads(model, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@cpu_float8
@pytest.mark.parametrize("kinds", [("mlp",), ("attention",), ("attention", "mlp")])
def test_the_models_training_loss_in_float8_is_close_and_its_validation_the_same(kinds, monkeypatch):
    from windowgpt_cli.model import fp8_ops

    x = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(7))
    plain_model, fp8_model = perturbed_tiny().train(), perturbed_tiny().train()
    fp8_model.train_ops = ops = Fp8Ops(kinds)
    in_float8, rounded = [], []
    monkeypatch.setattr(fp8_ops, "fp8_linear", lambda a, w: in_float8.append(1) or fp8_linear(a, w))

    def product(a, w, kind, product=ops.product):  # the kinds whose products reached float8
        before = len(in_float8)
        out = product(a, w, kind)
        rounded.extend([kind] * (len(in_float8) - before))
        return out
    ops.product = product
    plain, plain_grads = loss_and_grads(plain_model, x, y)
    fp8, fp8_grads = loss_and_grads(fp8_model, x, y)
    assert set(rounded) == set(kinds)
    assert plain != fp8 and torch.allclose(plain, fp8, rtol=0.01)
    assert plain_grads.keys() == fp8_grads.keys()
    for name, grad in plain_grads.items():
        assert F.cosine_similarity(grad.flatten(), fp8_grads[name].flatten(), dim=0) > 0.98, name
    with torch.no_grad():  # validation and scoring: bfloat16's (here float32's) products
        assert torch.equal(plain_model(x, y), fp8_model(x, y))


def test_a_product_that_does_not_fit_runs_as_torchs():
    x, up, down = torch.randn(3, 24), torch.randn(40, 24), torch.randn(24, 40)
    assert torch.equal(Fp8Ops(("mlp",)).mlp(x, up, down, 0.5), F.linear(F.leaky_relu(x @ up.t(), 0.5).square(), down))
    with pytest.raises(ValueError, match="kinds are attention, mlp"):
        Fp8Ops(("head",))


@cpu_float8
@pytest.mark.parametrize("flags", [["--fp8-mlp"], ["--fp8-attention", "--fp8-mlp"]])
def test_train_in_float8_runs_and_changes_only_the_rounding(tiny_data_dir, tmp_path, flags):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    val_losses = {}
    for asked in ([], flags):
        out = tmp_path / ("fp8" if asked else "plain")
        result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out", str(out),
                                          "--iterations", "4", *asked])
        assert result.exit_code == 0, result.output
        assert ": off on this device" not in (out / "train.log").read_text()
        train = json.loads((out / "config.json").read_text())["train"]
        assert (train["fp8_mlp"], train["fp8_attention"]) == ("--fp8-mlp" in asked, "--fp8-attention" in asked)
        val_losses[bool(asked)] = json.loads((out / "summary.json").read_text())["val_loss"]
    # the same start and data: after 4 steps the weights differ by the products' rounding alone
    assert val_losses[True] != val_losses[False] and val_losses[True] == pytest.approx(val_losses[False], rel=1e-3)


@pytest.mark.parametrize("fp8_flag", ["--fp8-mlp", "--fp8-attention"])
def test_float8_and_fused_mlp_together_are_refused(tiny_data_dir, tmp_path, fp8_flag):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out",
                                      str(tmp_path / "run"), fp8_flag, "--fused-mlp", "triton"])
    assert result.exit_code in (1, 2) and "cannot be combined with fp8_mlp or fp8_attention" in result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_available(torch.device("cuda"))),
                    reason="needs a CUDA GPU with float8 products")
def test_on_cuda_the_compiled_step_in_float8_is_close_to_bfloat16s():
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences: with its products in float8 within 1% of bfloat16's, every bank's gradient
    pointing the same way (cosine over 0.98)."""
    from conftest import bank_grads, compiled_step_on_cuda

    def variant(fp8: bool):
        def set_up(model):
            model.train_ops = Fp8Ops(("attention", "mlp")) if fp8 else None
        return set_up

    (plain, plain_grads), (fp8, fp8_grads) = compiled_step_on_cuda([variant(False), variant(True)], bank_grads)
    assert plain_grads and abs(plain - fp8) < 0.01 * plain
    for plain_grad, fp8_grad in zip(plain_grads, fp8_grads):
        assert plain_grad.abs().amax() > 0
        assert F.cosine_similarity(plain_grad.flatten(), fp8_grad.flatten(), dim=0) > 0.98


@cpu_float8
def test_with_train_ops_off_the_training_forward_multiplies_as_eval_does():
    x = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(6))
    plain_model, fp8_model = perturbed_tiny().train(), perturbed_tiny().train()
    fp8_model.train_ops = Fp8Ops(("attention", "mlp"))
    assert not torch.equal(plain_model(x, x), fp8_model(x, x))
    fp8_model.train_ops_on = False  # gradients on, as validation through a compiled training graph runs
    assert torch.equal(plain_model(x, x), fp8_model(x, x))


@cpu_float8
def test_training_validates_and_warms_up_the_model_as_eval_sees_it(tiny_data_dir, tmp_path, monkeypatch):
    """With float8 products, validation (as it runs on a compiled model, gradients on) turns
    the training forward's ops off; the warm-up runs that state too, so that its graph is
    compiled before training; every training step runs them on."""
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app
    from windowgpt_cli.train import trainer

    steps, validations = [], []

    def optimizer_step(self, next_batch, scale, passes=None, original=trainer.Trainer._optimizer_step):
        steps.append((passes, self.s.model.train_ops_on))
        return original(self, next_batch, scale, **({} if passes is None else {"passes": passes}))

    def evaluate(loss_fn, *args, original=trainer.evaluate_standard, **kwargs):
        validations.append(loss_fn.train_ops_on)
        return original(loss_fn, *args, **kwargs)

    monkeypatch.setattr(trainer.Trainer, "_optimizer_step", optimizer_step)
    monkeypatch.setattr(trainer, "evaluate_standard", evaluate)
    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out",
                                      str(tmp_path / "run"), "--iterations", "3", "--fp8-mlp"])
    assert result.exit_code == 0, result.output
    warm_up, training = steps[:2], steps[2:]  # the tiny preset warms up for 2 steps
    assert [on for _, on in warm_up] == [True, False] and all(passes == 1 for passes, _ in warm_up)
    assert len(training) == 3 and all(on for _, on in training)
    assert validations and not any(validations)  # the last step's and the EMA weights'
