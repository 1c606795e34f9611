"""`fused_mlp quack` (`kernels.quack_products`): LeakyReLU² as quack's GEMM epilogues
compute it (the same bodies on tensors here), the fused op's wiring around quack's two
products (stood in for by torch's on the CPU: the op, its saved tensors and its backward are
what runs), the setting's checks, and on a Hopper GPU with quack-kernels the compiled step
against the compiler's."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from conftest import compiled_steps_agree, interpret_kernels_without_cuda

interpret_kernels_without_cuda()

from windowgpt_cli.config import RunConfig, validate  # noqa: E402
from windowgpt_cli.errors import ConfigError, SettingError  # noqa: E402
from windowgpt_cli.kernels import fused_mlp  # noqa: E402
from windowgpt_cli.kernels import quack_products as qp  # noqa: E402
from windowgpt_cli.model.fused_train_ops import ProductEpilogueOps  # noqa: E402
from windowgpt_cli.model.ops import TORCH_OPS  # noqa: E402
from windowgpt_cli.train import trainer  # noqa: E402

SLOPE = 0.5


@pytest.mark.parametrize("slope", [0.0, 0.25, 0.5, 1.0])
def test_the_epilogues_give_leaky_square_and_its_derivative(slope):
    activation, derivative = qp.leaky_square_epilogues(slope, torch.maximum)
    x = torch.linspace(-3, 3, 241, dtype=torch.float64).requires_grad_(True)
    want = TORCH_OPS.leaky_square(x, slope)
    dout = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (want_grad,) = torch.autograd.grad(want, x, dout)
    grad, again = derivative(x.detach(), dout)
    assert torch.allclose(activation(x.detach()), want.detach()) and torch.allclose(again, want.detach())
    assert torch.allclose(grad, want_grad)


def test_the_epilogues_take_pairs_of_values_as_quack_passes_them():
    activation, derivative = qp.leaky_square_epilogues(SLOPE, torch.maximum)
    a, b = torch.tensor([-2.0, 1.5]), torch.tensor([3.0, -0.5])
    assert [t.tolist() for t in activation((a, b))] == [activation(a).tolist(), activation(b).tolist()]
    (grad_a, grad_b), (out_a, out_b) = derivative((a, b), (b, a))
    assert torch.equal(grad_a, derivative(a, b)[0]) and torch.equal(grad_b, derivative(b, a)[0])
    assert torch.equal(out_a, activation(a)) and torch.equal(out_b, activation(b))


def pass_through(function):
    """A decorator like cutlass's `dsl_user_op` as far as naming goes (functools.wraps)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapper


def test_each_slope_registers_its_epilogues_under_a_name_of_its_own_that_the_wrapper_keeps():
    """quack keys an installed, wrapped epilogue by its qualified name alone: a name shared by
    two slopes would hand one slope's compiled kernel to the other."""
    activations, derivatives = {}, {}
    slopes = (0.5, 0.25, 1e-05)
    names = [qp.register_epilogues(slope, torch.maximum, pass_through, activations, derivatives) for slope in slopes]
    assert len(set(names)) == len(slopes) and set(activations) == set(derivatives) == set(names)
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    for slope, name in zip(slopes, names):
        assert name.isidentifier()
        assert activations[name].__qualname__ == name and derivatives[name].__qualname__ == f"{name}_derivative"
        assert torch.allclose(activations[name](x), TORCH_OPS.leaky_square(x, slope))
        grad, again = derivatives[name](x, torch.ones_like(x))
        assert torch.allclose(grad, qp.leaky_square_epilogues(slope, torch.maximum)[1](x, torch.ones_like(x))[0])
        assert torch.equal(again, activations[name](x))


def test_the_code_digest_follows_what_a_function_computes_nested_functions_included():
    def compiled(source: str):
        scope: dict = {}
        exec(compile(source, "<formulas>", "exec"), scope)
        return scope["formulas"].__code__

    base = "def formulas(s):\n    def inner(x):\n        return max(x, s * x) ** 2\n    return inner\n"
    assert qp.code_digest(compiled(base)) == qp.code_digest(compiled(base))
    for changed in (base.replace("** 2", "** 3"), base.replace("max", "min"), base.replace("s * x", "x * s")):
        assert qp.code_digest(compiled(changed)) != qp.code_digest(compiled(base))
    assert qp.code_digest(qp.leaky_square_epilogues.__code__)[:12] in qp.epilogue_name(SLOPE)


def operands(rows: int = 24, dim: int = 32, hidden: int = 64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, dim, generator=g).bfloat16(), (0.3 * torch.randn(hidden, dim, generator=g)).bfloat16(),
            (0.3 * torch.randn(dim, hidden, generator=g)).bfloat16())


@pytest.fixture
def torch_products(monkeypatch):
    """quack's two products as torch computes them (float32 from the bf16 operands, stored
    bf16), through the epilogue bodies above; counts each call."""
    activation, derivative = qp.leaky_square_epilogues(SLOPE, torch.maximum)
    calls = {"up": 0, "back": 0, "grad": 0}

    def up(x, up_w, slope):
        calls["up"] += 1
        product = F.linear(x.float(), up_w.float())
        return activation(product).bfloat16(), product.bfloat16()

    def back(grad, down_w, product, slope):
        calls["back"] += 1
        grad_product, hidden = derivative(product.float(), grad.float() @ down_w.float())
        return grad_product.bfloat16(), hidden.bfloat16()

    def grad_only(grad, down_w, product, slope):  # through the epilogue's own body
        calls["grad"] += 1
        return qp.gradient_only(derivative)(grad.float() @ down_w.float(), product.float())["D"].bfloat16()

    monkeypatch.setattr(fused_mlp, "leaky_square_up", up)
    monkeypatch.setattr(fused_mlp, "leaky_square_back", back)
    monkeypatch.setattr(fused_mlp, "leaky_square_grad", grad_only)
    return calls


def mlp_results(mlp, x, up_w, down_w):
    """The output and the three gradients of mlp(x, up_w, down_w) under a fixed output gradient."""
    inputs = [t.detach().clone().requires_grad_(True) for t in (x, up_w, down_w)]
    out = mlp(*inputs)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach().float(), [t.grad.float() for t in inputs]


@pytest.mark.parametrize("keep", [True, False])
def test_the_op_with_quacks_products_gives_torchs_output_and_gradients(torch_products, keep):
    x, up_w, down_w = operands()
    got, got_grads = mlp_results(lambda a, u, d: fused_mlp.leaky_square_mlp(a, u, d, SLOPE, products="quack",
                                                                            keep_activation=keep), x, up_w, down_w)
    want, want_grads = mlp_results(lambda a, u, d: F.linear(TORCH_OPS.leaky_square(F.linear(a.float(), u.float()),
                                                                                   SLOPE), d.float()), x, up_w, down_w)
    assert torch_products == ({"up": 1, "back": 0, "grad": 1} if keep else {"up": 1, "back": 1, "grad": 0})
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()
    for g, w in zip(got_grads, want_grads):
        assert g.shape == w.shape and (g - w).abs().max() <= 2 ** -5 * w.abs().max()


def test_kept_or_not_the_gradients_through_the_product_are_the_same_and_the_weights_differ_by_rounding(
        torch_products):
    """The gradient product's values do not depend on where the activation comes from; the
    down projection's weight gradient reads the forward's activation (from the unrounded
    product) or the backward's (from the bf16 one)."""
    x, up_w, down_w = operands()
    (out, (dx, d_up, d_down)), (out_again, (dx_again, d_up_again, d_down_again)) = (
        mlp_results(lambda a, u, d, keep=keep: fused_mlp.leaky_square_mlp(a, u, d, SLOPE, products="quack",
                                                                          keep_activation=keep), x, up_w, down_w)
        for keep in (True, False))
    assert torch.equal(out, out_again) and torch.equal(dx, dx_again) and torch.equal(d_up, d_up_again)
    assert not torch.equal(d_down, d_down_again)
    assert (d_down - d_down_again).abs().max() <= 2 ** -5 * d_down.abs().max()


def test_the_gradient_epilogue_stores_the_gradient_alone_as_the_derivative_gives_it():
    activation, derivative = qp.leaky_square_epilogues(SLOPE, torch.maximum)
    product, dout = torch.linspace(-3, 3, 61, dtype=torch.float64), torch.linspace(2, -1, 61, dtype=torch.float64)
    stored = qp.gradient_only(derivative)(dout, product)
    assert list(stored) == ["D"] and torch.equal(stored["D"], derivative(product, dout)[0])


@pytest.mark.parametrize("keep, kept_shapes", [(True, 2), (False, 1)])
def test_the_op_keeps_the_activation_for_quacks_backward_only_where_asked(torch_products, keep, kept_shapes):
    """Not kept, the backward's product stores the activation again and the forward's is not saved."""
    x, up_w, down_w = (t.requires_grad_(True) for t in operands())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        fused_mlp.leaky_square_mlp(x, up_w, down_w, SLOPE, products="quack", keep_activation=keep)
    assert saved.count(torch.Size([24, 64])) == kept_shapes  # the product, and the activation where kept
    assert (torch.Size([0]) in saved) is not keep


def test_quacks_products_take_bf16_operands_in_whole_vectors():
    x, up_w, down_w = operands()
    assert fused_mlp.mlp_fits(x, up_w, down_w, fused_mlp.TRAINING_TILES, "quack")
    assert not fused_mlp.mlp_fits(x.float(), up_w.float(), down_w.float(), fused_mlp.TRAINING_TILES, "quack")
    assert not qp.quack_fits(x[:, :30], up_w[:, :30], down_w[:30])  # 30 columns: not whole 16-byte vectors
    assert ProductEpilogueOps(products="quack").products == "quack"


def test_the_setting_names_a_provider_and_quack_takes_slopes_up_to_one():
    cfg = RunConfig()
    cfg.train.fused_mlp = "cutlass"
    with pytest.raises(SettingError, match="one of auto, off, triton, quack"):
        validate(cfg)
    cfg = RunConfig()
    cfg.train.fused_mlp, cfg.model.negative_slope = "quack", 1.5
    with pytest.raises(SettingError, match="negative_slope in 0..1"):
        validate(cfg)
    for other in ("auto", "off", "triton"):  # only quack's named products need it
        cfg.train.fused_mlp = other
        validate(cfg)


def hopper(monkeypatch, quack: bool) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(trainer, "quack_targets", lambda device: quack)


def test_quacks_products_off_on_a_cpu_and_an_error_on_a_hopper_gpu_without_the_package(monkeypatch):
    cfg = RunConfig()
    cfg.train.fused_mlp = "quack"
    assert trainer.fused_mlp_products(cfg, torch.device("cpu")) is None
    hopper(monkeypatch, quack=False)
    with pytest.raises(ConfigError, match="needs the quack-kernels package"):
        trainer.fused_mlp_products(cfg, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert trainer.fused_mlp_products(cfg, torch.device("cuda")) is None  # an Ampere GPU: off, as the Triton products


def test_auto_takes_quacks_products_where_they_run_for_bf16_products_of_a_slope_they_take(monkeypatch):
    cfg = RunConfig()
    assert cfg.train.fused_mlp == "auto"
    assert trainer.fused_mlp_products(cfg, torch.device("cpu")) is None
    hopper(monkeypatch, quack=False)
    assert trainer.fused_mlp_products(cfg, torch.device("cuda")) is None  # no package: off, never an error
    hopper(monkeypatch, quack=True)
    assert trainer.fused_mlp_products(cfg, torch.device("cuda")) == "quack"
    for setting, value in (("fp8_mlp", True), ("fp8_attention", True)):
        changed = RunConfig()
        setattr(changed.train, setting, value)
        validate(changed)  # auto with float8 is no conflict: auto leaves the MLP to float8
        assert trainer.fused_mlp_products(changed, torch.device("cuda")) is None, setting
    steep = RunConfig()
    steep.model.negative_slope = 1.5
    assert trainer.fused_mlp_products(steep, torch.device("cuda")) is None
    named = RunConfig()
    named.train.fused_mlp = "off"
    assert trainer.fused_mlp_products(named, torch.device("cuda")) is None


def test_a_product_quack_cannot_run_is_one_clear_error_and_memory_stays_memory():
    def broken():
        raise TypeError("gemm_act() got an unexpected keyword argument 'store_preact'\nmore lines")

    with pytest.raises(ConfigError, match=r"^fused_mlp quack: quack-kernels could not run its product here "
                                          r"\(TypeError: gemm_act\(\) got an unexpected keyword argument "
                                          r"'store_preact'\); train with --fused-mlp off$"):
        qp.through_quack(broken)

    def full():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        qp.through_quack(full)
    assert qp.through_quack(lambda: 3) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and qp.quack_targets(torch.device("cuda"))),
                    reason="needs a Hopper or Blackwell GPU with quack-kernels")
def test_on_cuda_the_compiled_step_with_quacks_products_gives_the_same_loss_and_gradients():
    """The full-size model's compiled training loss in bf16 autocast, at a micro-batch of 8
    sequences: the loss within 1e-3 of the compiler's steps', the MLP banks' gradients within
    2% of their size."""
    compiled_steps_agree(None, ProductEpilogueOps(products="quack"),
                         lambda model: [model.mlp_up_bank.grad, model.mlp_down_bank.grad])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and qp.quack_targets(torch.device("cuda"))),
                    reason="needs a Hopper or Blackwell GPU with quack-kernels")
def test_on_cuda_the_gradient_alone_is_the_gradient_quacks_derivative_product_stores():
    g = torch.Generator(device="cuda").manual_seed(0)
    grad, down_w, product = (torch.randn(*shape, device="cuda", generator=g).bfloat16()
                             for shape in ((4096, 512), (512, 1536), (4096, 1536)))
    alone = qp.leaky_square_grad(grad, down_w, product, SLOPE)
    with_activation, _ = qp.leaky_square_back(grad, down_w, product, SLOPE)
    want = qp.leaky_square_epilogues(SLOPE, torch.maximum)[1](product.float(), grad.float() @ down_w.float())[0]
    assert alone.shape == want.shape and alone.dtype == torch.bfloat16
    assert (alone.float() - with_activation.float()).abs().max() <= 2 ** -7 * want.abs().max()
    assert (alone.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU does")
def test_training_on_a_cpu_says_quacks_products_are_off(tiny_data_dir, tmp_path):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app

    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(tiny_data_dir), "--out",
                                      str(tmp_path / "run"), "--iterations", "2", "--fused-mlp", "quack"])
    assert result.exit_code == 0, result.output
    log = (tmp_path / "run" / "train.log").read_text()
    assert "fused_mlp: off on this device (its quack products need a Hopper or Blackwell GPU)" in log
    assert "fused_mlp:off keep_mlp_activation:off fold_output_scales:off copy_kv_heads:off" in log
    assert RunConfig.load(tmp_path / "run" / "config.json").train.fused_mlp == "quack"


def test_auto_trains_with_the_compilers_mlp_where_quack_fails_at_its_first_product(tiny_data_dir, tmp_path,
                                                                                    monkeypatch):
    """quack loads but cannot build its product here (an install it was not built for): a
    run left to auto goes on with the compiler's MLP, as `--fused-mlp off` trains, and says
    so; a run that named quack ends with the one-line error."""
    import json

    from test_train import metrics, tiny_cfg
    from windowgpt_cli.train.run import train

    monkeypatch.setattr(trainer, "quack_targets", lambda device: True)
    calls = []

    def unbuildable():
        raise RuntimeError("no kernel image for sm_90a\nmore")

    def failing(self, x, up_w, down_w, negative_slope):
        calls.append(x.shape)
        return qp.through_quack(unbuildable)

    monkeypatch.setattr(ProductEpilogueOps, "mlp", failing)
    losses = {}
    for setting in ("auto", "off"):
        train(tiny_cfg(tiny_data_dir, iterations=3, train_log_every=1, fused_mlp=setting), tmp_path / setting)
        losses[setting] = [r["train_loss"] for r in metrics(tmp_path / setting) if "train_loss" in r]
    log = (tmp_path / "auto" / "train.log").read_text()
    # auto chose quack's products, which failed
    assert calls and "fused_mlp:quack keep_mlp_activation:on fold_output_scales:off copy_kv_heads:off" in log
    assert ("fused_mlp: auto leaves quack's products (RuntimeError: no kernel image for sm_90a); the compiler's MLP "
            "instead") in log
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["kernels"]["fused_mlp"] == "off"
    assert len(losses["auto"]) == 3 and losses["auto"] == losses["off"]  # the failed warm-up step left nothing
    with pytest.raises(qp.QuackUnavailable, match="train with --fused-mlp off$"):
        train(tiny_cfg(tiny_data_dir, iterations=3, fused_mlp="quack"), tmp_path / "quack")


def test_where_auto_leaves_quacks_products_the_other_fused_ops_stay(tiny_data_dir, tmp_path, monkeypatch):
    """The fallback to the compiler's MLP keeps `--fused-head-prep on` (the op stood in for by
    one that counts its calls and leaves the heads to torch)."""
    import json

    from test_train import tiny_cfg
    from windowgpt_cli.kernels import fused_heads
    from windowgpt_cli.train.run import train

    monkeypatch.setattr(trainer, "quack_targets", lambda device: True)
    monkeypatch.setattr(trainer, "triton_available", lambda device: True)
    def unbuildable():
        raise RuntimeError("no kernel image for sm_90a")

    monkeypatch.setattr(ProductEpilogueOps, "mlp", lambda self, *args: qp.through_quack(unbuildable))
    calls = []
    monkeypatch.setattr(fused_heads, "fused_head_prep", lambda *args: calls.append(args[0].shape))
    train(tiny_cfg(tiny_data_dir, iterations=2, fused_mlp="auto", fused_head_prep="on"), tmp_path / "run")
    kernels = json.loads((tmp_path / "run" / "summary.json").read_text())["kernels"]
    assert kernels["fused_mlp"] == "off" and kernels["fused_head_prep"] == "on" and calls
