"""`train --stack-qkv` (auto: qk on a CUDA device): each block's query, key and value matrices
as one product in the training forward, its slices read in place by the heads' steps, each
slice's gradient back through its own matrix; with `qk`, the queries' and keys' steps one op
whose gradient is one slice. The same loss and gradients as three products (here in float32,
where only rounding differs), with torch's steps, the fused heads' op and the pair op,
compiled into one graph, and a run that says which it took."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from windowgpt_cli.config import RunConfig
from windowgpt_cli.model import ops as ops_module
from windowgpt_cli.model.ops import TorchOps
from windowgpt_cli.train.run import train
from windowgpt_cli.train import trainer
from windowgpt_cli.train.trainer import stack_qkv_on

from conftest import interpret_kernels_without_cuda
from test_model import perturbed_tiny
from test_train import metrics, tiny_cfg

interpret_kernels_without_cuda()

from windowgpt_cli.kernels.fused_heads import fused_head_prep, fused_head_prep_pair  # noqa: E402


def loss_and_gradients(model, stack: bool, ops: TorchOps | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(2, 1024, (2, 33), generator=torch.Generator().manual_seed(5))
    model.zero_grad(set_to_none=True)
    model.stack_qkv, model.train_ops = stack, ops
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def fused_heads_ops(pair: bool = False) -> TorchOps:
    ops = TorchOps()
    ops.fused_heads = fused_head_prep
    ops.fused_head_pair = fused_head_prep_pair if pair else None
    return ops


@pytest.mark.usefixtures("interpreter_fixes")
@pytest.mark.parametrize("ops", [None, "fused heads", "fused pair"])
def test_one_stacked_product_gives_the_same_loss_and_gradients(ops, monkeypatch):
    model = perturbed_tiny()
    widths, pairs = [], []
    original = F.linear
    monkeypatch.setattr(ops_module.F, "linear", lambda x, w, *a: widths.append(w.size(0)) or original(x, w, *a))
    original_pair, original_split = TorchOps.head_prep_pair, TorchOps.split_product
    monkeypatch.setattr(TorchOps, "head_prep_pair", lambda self, x, *a: pairs.append(x.shape) or original_pair(
        self, x, *a))
    splits = []
    monkeypatch.setattr(TorchOps, "split_product", lambda self, x, w, sizes, kind: splits.append(len(sizes)) or
                        original_split(self, x, w, sizes, kind))
    plain_loss, plain = loss_and_gradients(model, False, fused_heads_ops(ops == "fused pair") if ops else None)
    plain_widths = list(widths)
    widths.clear()
    assert not pairs  # three products: nothing to pair
    stacked_loss, stacked = loss_and_gradients(model, True, fused_heads_ops(ops == "fused pair") if ops else None)
    cfg = model.cfg
    qkv = cfg.model_dim + 2 * cfg.kv_dim
    assert plain_widths.count(cfg.kv_dim) == 2 * cfg.num_layers and cfg.kv_dim not in widths  # no key, value products
    assert widths.count(qkv) == plain_widths.count(qkv) + cfg.num_layers  # but one a block for the three
    assert len(widths) == len(plain_widths) - 2 * cfg.num_layers
    assert len(pairs) == (cfg.num_layers if ops == "fused pair" else 0)
    assert splits == [2 if ops == "fused pair" else 3] * cfg.num_layers  # (q and k, v) or (q, k, v)
    assert torch.allclose(stacked_loss, plain_loss, rtol=1e-5)
    assert stacked.keys() == plain.keys() and {"qo_bank", "kv_bank", "blocks.0.attn.q_gain"} <= stacked.keys()
    for name, grad in plain.items():
        assert torch.allclose(stacked[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max()), name


def test_a_run_with_stacked_products_follows_the_same_losses_and_says_so(tiny_data_dir, tmp_path):
    """On a CPU qk stacks the products but cannot pair the heads' steps (no fused heads): the
    log says so, and what ran."""
    runs = {}
    for setting, ran in (("off", "off"), ("on", "on"), ("qk", "on")):
        train(tiny_cfg(tiny_data_dir, iterations=3, train_log_every=1, train_batch_tokens=2048, stack_qkv=setting),
              tmp_path / setting)
        runs[setting] = [r["train_loss"] for r in metrics(tmp_path / setting) if "train_loss" in r]
        log = (tmp_path / setting / "train.log").read_text()
        assert f"stack_qkv:{ran}" in log and ("stack_qkv: on, not qk" in log) == (setting == "qk")
        assert json.loads((tmp_path / setting / "summary.json").read_text())["kernels"]["stack_qkv"] == ran
        assert RunConfig.load(tmp_path / setting / "config.json").train.stack_qkv == setting
    assert len(runs["on"]) == 3 and runs["on"] == pytest.approx(runs["off"], rel=1e-4) == runs["qk"]
    cfg = RunConfig()
    assert cfg.train.stack_qkv == "auto"
    assert stack_qkv_on(RunConfig(train=dataclasses.replace(cfg.train, stack_qkv="qk")), torch.device("cpu"))
    assert stack_qkv_on(cfg, torch.device("cuda")) and not stack_qkv_on(cfg, torch.device("cpu"))
    for setting, stacks in (("on", True), ("off", False)):
        cfg.train.stack_qkv = setting
        assert all(stack_qkv_on(cfg, torch.device(kind)) == stacks for kind in ("cpu", "cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_record_step_with_stacked_products_gives_the_same_loss_and_gradients():
    """The record model's compiled step, the heads' steps as the fused op (whose kernels then
    read the stacked product's slices in place), with three products, with one, and with one
    whose queries and keys go through the pair op: the loss within 1e-3 and the banks'
    gradients within 2% of their size (`assert_compiled_record_steps_agree`)."""
    from conftest import assert_compiled_record_steps_agree

    def stacked(stack: bool, pair: bool = False):
        def change(model):
            model.train_ops, model.stack_qkv = fused_heads_ops(pair), stack
        return change

    assert_compiled_record_steps_agree(stacked(False), stacked(True), stacked(True, pair=True))


def test_the_split_product_takes_each_slices_gradient_through_its_own_matrix(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(2, 5, 8, generator=g), torch.randn(12, 8, generator=g)
    sizes = (6, 4, 2)
    weights = [torch.randn(2, 5, n, generator=g) for n in sizes]

    def loss(fn, x, w, used=(0, 1, 2)):
        return sum((part * weights[i]).sum() for i, part in enumerate(fn(x, w)) if i in used)

    for used in ((0, 1, 2), (0, 2)):  # a slice without a gradient: none flows through its matrix
        inputs, want_inputs = ([t.clone().requires_grad_(True) for t in (x, weight)] for _ in range(2))
        joined = []
        original = torch.cat
        monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: joined.append(ts[0].shape) or original(ts, *a, **k))
        loss(lambda x, w: ops_module.split_linear(x, w, sizes), *inputs, used).backward()
        monkeypatch.setattr(torch, "cat", original)
        loss(lambda x, w: F.linear(x, w).split(sizes, -1), *want_inputs, used).backward()
        assert all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(inputs, want_inputs))
        assert all(shape[0] == sizes[0] for shape in joined)  # only the matrices' gradients are joined
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(TorchOps().split_product(x, weight, sizes, "attention"),
                                                     F.linear(x, weight).split(sizes, -1)))


def test_the_split_product_compiles_into_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(2, 5, 8, generator=g, requires_grad=True), torch.randn(12, 8, generator=g)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: [t.relu() for t in ops_module.split_linear(x * 2, w, (6, 4, 2))],
                             backend=counter, fullgraph=True)
    sum(t.sum() for t in compiled(x, weight)).backward()
    want = x.detach().clone().requires_grad_(True)
    sum(t.relu().sum() for t in F.linear(want * 2, weight).split((6, 4, 2), -1)).backward()
    assert counter.frame_count == 1 and torch.allclose(x.grad, want.grad, atol=1e-5)


@pytest.mark.parametrize("setting, paired", [("auto", True), ("on", False), ("qk", True)])
def test_qk_pairs_the_heads_steps_where_the_fused_heads_run(setting, paired, monkeypatch):
    model = perturbed_tiny()
    cfg = RunConfig(train=dataclasses.replace(RunConfig().train, stack_qkv=setting))
    monkeypatch.setattr(trainer, "triton_available", lambda device: True)
    cuda = torch.device("cuda")
    model.stack_qkv = stack_qkv_on(cfg, cuda)
    trainer.set_fused_ops(model, cfg, cuda)
    assert (model.train_ops.fused_head_pair is fused_head_prep_pair) == paired
    assert trainer.stacked_as(model) == ("qk" if paired else "on")
    assert trainer.pairs_heads(cfg, torch.device("cpu")) == (setting == "qk")  # auto pairs on CUDA only
    cfg.train.fused_head_prep = "off"  # no fused heads: nothing to pair
    model.train_ops = None
    trainer.set_fused_ops(model, cfg, cuda)
    assert trainer.stacked_as(model) == "on"
    model.stack_qkv = False
    assert trainer.stacked_as(model) == "off"
