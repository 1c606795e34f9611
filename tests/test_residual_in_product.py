"""`train --residual-in-product`: each block's input added to its attention output inside the
output projection's product (torch.addmm), where the output scales fold. The same function and
gradients as the sum formed after the product (in float32 only rounding differs); nowhere else:
not with the scales unfolded, not at chosen positions, not in a parallel block."""
from __future__ import annotations

import pytest
import torch

from windowgpt_cli.model.fp8_ops import Fp8Ops
from windowgpt_cli.model.ops import TorchOps
from windowgpt_cli.train.run import train

from test_model import perturbed_tiny
from test_train import metrics, tiny_cfg


def loss_and_gradients(model, in_product: bool, fold: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(2, 1024, (2, 48), generator=torch.Generator().manual_seed(7))
    model.zero_grad(set_to_none=True)
    model.fold_output_scales = fold
    model.train_ops = TorchOps()
    model.train_ops.sum_in_product = in_product
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def counting_addmm(monkeypatch) -> list[tuple[int, ...]]:
    shapes, original = [], torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda base, x, w, **kw: shapes.append(tuple(base.shape)) or original(
        base, x, w, **kw))
    return shapes


@pytest.mark.parametrize("options", [{}, {"parallel_start_layer": 2}], ids=["sequential", "parallel lanes"])
def test_the_sum_in_the_product_gives_the_same_loss_and_gradients(options, monkeypatch):
    model = perturbed_tiny(**options)
    plain_loss, plain = loss_and_gradients(model, False)
    shapes = counting_addmm(monkeypatch)
    loss, grads = loss_and_gradients(model, True)
    assert torch.allclose(loss, plain_loss, rtol=1e-5)
    assert grads.keys() == plain.keys() and "blocks.0.attn_scale" in grads  # the folded scale still learns
    for name, grad in plain.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max()), name
    sequential = model.cfg.parallel_start_layer or model.num_layers
    assert shapes == [(2 * 47, model.cfg.model_dim)] * sequential  # each sequential block's attention, no other


def test_without_folded_scales_the_sum_stays_after_the_product(monkeypatch):
    model = perturbed_tiny()
    shapes = counting_addmm(monkeypatch)
    plain_loss, _ = loss_and_gradients(model, False, fold=False)
    loss, _ = loss_and_gradients(model, True, fold=False)
    assert shapes == [] and torch.equal(loss, plain_loss)


def test_the_product_onto_adds_its_base_once_in_each_dtype():
    base, x, w = torch.randn(2, 5, 8), torch.randn(2, 5, 6), torch.randn(8, 6)
    assert torch.allclose(TorchOps().product_onto(base, x, w, "attention"), base + x @ w.t(), atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        summed = TorchOps().product_onto(base.bfloat16(), x, w, "attention")
    assert summed.dtype == torch.bfloat16 and summed.shape == base.shape
    assert torch.allclose(summed.float(), base + x @ w.t(), rtol=2e-2, atol=2e-2)


def test_float8_products_keep_their_product_and_add_after_it(monkeypatch):
    ops = Fp8Ops(("attention",))
    calls = []
    monkeypatch.setattr(Fp8Ops, "product", lambda self, x, w, kind: calls.append(kind) or x @ w.t())
    base, x, w = torch.randn(3, 8), torch.randn(3, 6), torch.randn(8, 6)
    assert torch.allclose(ops.product_onto(base, x, w, "attention"), base + x @ w.t(), atol=1e-6)
    assert calls == ["attention"]
    ops.product_onto(base, x, w, "mlp")  # not a float8 kind: torch's addmm
    assert calls == ["attention"]


def test_training_with_the_sum_in_the_product_follows_the_same_losses(tiny_data_dir, tmp_path):
    runs = {}
    for name, flags in (("off", {}), ("on", {"residual_in_product": True}),
                        ("unfolded", {"residual_in_product": True, "fold_output_scales": "off"})):
        cfg = tiny_cfg(tiny_data_dir, iterations=4, train_log_every=1, train_batch_tokens=2048,
                       **{"fold_output_scales": "on", **flags})
        train(cfg, tmp_path / name)
        runs[name] = [r["train_loss"] for r in metrics(tmp_path / name) if "train_loss" in r]
        shown = "on" if name == "on" else "off"
        assert f"residual_in_product:{shown}" in (tmp_path / name / "train.log").read_text()
    assert len(runs["on"]) == 4 and runs["on"] == pytest.approx(runs["off"], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_record_step_keeps_the_sum_in_the_product_and_agrees():
    """The record model's compiled step with the scales folded, the sum after the product and in
    it: the loss within 1e-3, the banks' gradients within 2% (`assert_compiled_record_steps_agree`);
    and Inductor keeps an addmm whose sum a norm reads as cuBLAS's product (not a product and an
    addition it would fuse into the norm)."""
    from torch._inductor.utils import run_and_get_code

    from conftest import assert_compiled_record_steps_agree
    from windowgpt_cli.model.ops import rms_norm

    def summed(in_product: bool):
        def change(model):
            model.fold_output_scales, model.train_ops = True, TorchOps()
            model.train_ops.sum_in_product = in_product
        return change

    assert_compiled_record_steps_agree(summed(False), summed(True))
    base, x, w = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((4096, 512), (4096, 512),
                                                                                         (512, 512)))
    step = torch.compile(lambda base, x, w: rms_norm(TorchOps().product_onto(base, x, w, "attention")))
    _, code = run_and_get_code(step, base, x, w)
    assert "extern_kernels.addmm" in "\n".join(code)
