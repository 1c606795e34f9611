"""`train --fold-output-scales` (auto: on a CUDA device): each block's output scales multiplied into its output
projections' rows in the training forward. The same function and gradients as the scales
applied to the outputs (here in float32, where only rounding differs); not where an adapter
adds a term the scale must multiply too."""
from __future__ import annotations

import json

import pytest
import torch

from windowgpt_cli.config import RunConfig
from windowgpt_cli.model import gpt as gpt_module
from windowgpt_cli.model.ops import Residual
from windowgpt_cli.train.run import train
from windowgpt_cli.train.trainer import fold_output_scales_on

from test_model import perturbed_tiny
from test_train import metrics, tiny_cfg


def loss_and_gradients(model, fold: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(2, 1024, (2, 48), generator=torch.Generator().manual_seed(5))
    model.zero_grad(set_to_none=True)
    model.fold_output_scales = fold
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("options", [{}, {"parallel_start_layer": 2}], ids=["sequential", "parallel lanes"])
def test_folded_scales_give_the_same_loss_and_gradients(options, monkeypatch):
    model = perturbed_tiny(**options)
    assert all((block.attn_scale - 1).abs().amax() > 0.01 for block in model.blocks)  # scales that matter
    plain_loss, plain = loss_and_gradients(model, False)
    scales = []
    original_plus = Residual.plus
    monkeypatch.setattr(Residual, "plus", lambda self, delta, scale: scales.append(scale) or original_plus(
        self, delta, scale))
    folded_loss, folded = loss_and_gradients(model, True)
    assert torch.allclose(folded_loss, plain_loss, rtol=1e-5)
    assert folded.keys() == plain.keys() and {"blocks.0.attn_scale", "blocks.0.mlp_scale"} <= folded.keys()
    for name, grad in plain.items():
        assert torch.allclose(folded[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max()), name
    sequential = model.cfg.parallel_start_layer or model.num_layers
    assert len(scales) == 2 * sequential and all(scale is None for scale in scales)  # every output added unscaled


def test_the_fold_multiplies_each_projections_rows_and_leaves_a_block_with_an_adapter_alone():
    block = perturbed_tiny().blocks[1]
    out_w, down_w = torch.randn(64, 64), torch.randn(64, 128)
    folded_out, folded_down, attn_scale, mlp_scale = block.output_weights(out_w, down_w, True)
    assert attn_scale is None and mlp_scale is None
    assert torch.allclose(folded_out, block.attn_scale[:, None] * out_w)
    assert torch.allclose(folded_down, block.mlp_scale[:, None] * down_w)
    assert block.output_weights(out_w, down_w, False) == (out_w, down_w, block.attn_scale, block.mlp_scale)
    block.attn.adapter = lambda name, x: None
    assert block.output_weights(out_w, down_w, True) == (out_w, down_w, block.attn_scale, block.mlp_scale)


def test_training_with_folded_scales_follows_the_same_losses(tiny_data_dir, tmp_path, monkeypatch):
    runs, folds = {}, []
    original = gpt_module.Block.output_weights
    monkeypatch.setattr(gpt_module.Block, "output_weights", lambda self, out_w, down_w, fold: folds.append(fold) or
                        original(self, out_w, down_w, fold))
    for setting in ("off", "on"):
        folds.clear()
        cfg = tiny_cfg(tiny_data_dir, iterations=4, train_log_every=1, train_batch_tokens=2048,
                       fold_output_scales=setting)
        train(cfg, tmp_path / setting)
        runs[setting] = [r["train_loss"] for r in metrics(tmp_path / setting) if "train_loss" in r]
        assert folds and any(folds) == (setting == "on")  # validation and the training steps fold, or none does
        assert f"fold_output_scales:{setting}" in (tmp_path / setting / "train.log").read_text()
        kernels = json.loads((tmp_path / setting / "summary.json").read_text())["kernels"]
        assert kernels == {"attn_backend": kernels["attn_backend"], "fused_mlp": "off", "keep_mlp_activation": "off",
                           "fold_output_scales": setting, "copy_kv_heads": "off",
                           "stack_qkv": "off", "fused_head_prep": "off",
                           "fused_xsa": "off", "residual_in_product": "off"}
    assert len(runs["on"]) == 4 and runs["on"] == pytest.approx(runs["off"], rel=1e-4)
    assert RunConfig.load(tmp_path / "on" / "config.json").train.fold_output_scales == "on"


def test_auto_folds_on_a_cuda_device_only():
    cfg = RunConfig()
    assert cfg.train.fold_output_scales == "auto"
    assert fold_output_scales_on(cfg, torch.device("cuda")) and not fold_output_scales_on(cfg, torch.device("cpu"))
    for setting, folds in (("on", True), ("off", False)):
        cfg.train.fold_output_scales = setting
        assert all(fold_output_scales_on(cfg, torch.device(kind)) == folds for kind in ("cpu", "cuda"))
