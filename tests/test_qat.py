"""Quantization-aware training (`train --qat-start-fraction`): the grid a training forward
rounds the matrices to is the one `quantize` rounds them to, gradients pass straight
through, and training switches the rounding on at its fraction of the budget, with every
state the run takes compiled in the warm-up."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.cli.app import app
from windowgpt_cli.model.state_dict import BANK_NAMES
from windowgpt_cli.model.weight_grid import RowGrid
from windowgpt_cli.quant.schemes import QuantPlan, bank_grids, quantize_tensor
from windowgpt_cli.train.trainer import RECURRING, ROUNDING, TRAIN_OPS, switch_states

from test_model import perturbed_tiny
from test_train import metrics

EVERY_MATRIX = dict(passthrough_max_numel=0)  # the tiny model's matrices are under the reference's threshold


def weights(rows: int = 48, cols: int = 96, seed: int = 0) -> torch.Tensor:
    """A trained matrix's scale: every weight well under 1."""
    return 0.03 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("plan,name", [
    (QuantPlan(**EVERY_MATRIX), "blocks.0.mlp.fc.weight"),  # the reference's: the floor makes one grid, 1/31
    (QuantPlan(mlp_clip_sigmas=11.5, **EVERY_MATRIX), "blocks.0.mlp.fc.weight"),
    (QuantPlan(attn_clip_sigmas=13.0, clip_range=15, **EVERY_MATRIX), "blocks.1.attn.c_q.weight"),
])
def test_the_trained_grid_is_the_one_quantize_rounds_to(plan, name):
    w = weights()
    grid = RowGrid(plan.clip_range, plan.clip_sigmas(name), plan.scale_floor)
    assert torch.equal(grid.snap(w), quantize_tensor(name, w, plan).dequantize())


def test_rounding_passes_gradients_straight_through():
    w = weights().requires_grad_()
    upstream = torch.randn_like(w)
    grid = RowGrid(31)
    snapped = grid.snap(w)
    (snapped * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)
    scale = grid.scales(w.detach()).float()[:, None]  # float16's 1/31 for every row
    assert torch.equal(snapped.detach(), torch.round(snapped.detach() / scale) * scale)


def test_each_bank_gets_its_groups_grid_or_none_where_its_matrices_stay_float():
    model = perturbed_tiny()
    banks, layers = dict(model.named_parameters()), model.cfg.num_layers
    assert bank_grids(QuantPlan(), banks, layers) == (None,) * 4  # tiny matrices pass as floats
    grids = bank_grids(QuantPlan(mlp_clip_sigmas=11.5, scale_floor=False, **EVERY_MATRIX), banks, layers)
    assert grids == (RowGrid(31, 0.0, False), RowGrid(31, 0.0, False), RowGrid(31, 11.5, False),
                     RowGrid(31, 11.5, False))


def test_a_model_rounding_its_weights_computes_with_its_rounded_banks():
    model = perturbed_tiny()
    x = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = model.forward_logits(x)
    model.weight_grids = bank_grids(QuantPlan(**EVERY_MATRIX), dict(model.named_parameters()), model.cfg.num_layers)
    assert torch.equal(model.forward_logits(x), plain)  # rounding off: the weights as they are
    model.rounding_weights = True
    rounded = model.forward_logits(x)
    snapped = perturbed_tiny()
    with torch.no_grad():
        for name, grid in zip(BANK_NAMES, model.weight_grids):
            getattr(snapped, name).copy_(grid.snap(getattr(snapped, name)))
    assert torch.equal(rounded, snapped.forward_logits(x)) and not torch.equal(rounded, plain)


@pytest.mark.parametrize("fractions,validation_off,states", [
    ({}, (), [{}]),
    ({RECURRING: 0.5}, (), [{RECURRING: False}, {RECURRING: True}]),
    ({ROUNDING: 0.5}, (), [{ROUNDING: False}, {ROUNDING: True}]),
    # recurrence first: training's three states; validation's (rounding off) are among them
    ({RECURRING: 0.35, ROUNDING: 0.5}, (), [{RECURRING: False, ROUNDING: False}, {RECURRING: True, ROUNDING: False},
                                           {RECURRING: True, ROUNDING: True}]),
    # rounding first: validation at the end (recurrence on, rounding off) is a fourth
    ({RECURRING: 0.5, ROUNDING: 0.2}, (), [{ROUNDING: False, RECURRING: False}, {ROUNDING: True, RECURRING: False},
                                          {ROUNDING: True, RECURRING: True}, {ROUNDING: False, RECURRING: True}]),
    # float8 products: on in every training state, off in each one validation may take
    ({}, (TRAIN_OPS,), [{TRAIN_OPS: True}, {TRAIN_OPS: False}]),
    ({RECURRING: 0.35}, (TRAIN_OPS,), [{RECURRING: False, TRAIN_OPS: True}, {RECURRING: True, TRAIN_OPS: True},
                                       {RECURRING: False, TRAIN_OPS: False}, {RECURRING: True, TRAIN_OPS: False}]),
    ({ROUNDING: 0.5}, (TRAIN_OPS,), [{ROUNDING: False, TRAIN_OPS: True}, {ROUNDING: True, TRAIN_OPS: True},
                                     {ROUNDING: False, TRAIN_OPS: False}]),
])
def test_the_warm_up_compiles_every_state_training_and_validation_take(fractions, validation_off, states):
    assert switch_states(fractions, validation_off) == states


def _train(data_dir, out, *flags: str) -> str:
    result = CliRunner().invoke(app, ["train", "--preset", "tiny", "--data", str(data_dir), "--out", str(out),
                                      "--iterations", "6", "--warmdown-iters", "2", *flags])
    assert result.exit_code == 0, result.output
    return (out / "train.log").read_text()


def test_training_rounds_the_matrices_from_its_fraction_of_the_budget_on(tiny_data_dir, tmp_path):
    """The steps before the switch train as without it; the first after it does not."""
    plain_log = _train(tiny_data_dir, tmp_path / "plain", "--quant-passthrough-max-numel", "0")
    log = _train(tiny_data_dir, tmp_path / "qat", "--quant-passthrough-max-numel", "0", "--qat-start-fraction", "0.5")
    assert "qat:grids qo_bank:+-31/rowmax(floor 1/31)" in log and "qat:on step:3" in log and "qat:" not in plain_log
    losses = [[m["train_loss"] for m in metrics(tmp_path / run) if "train_loss" in m] for run in ("plain", "qat")]
    assert losses[0][:3] == losses[1][:3] and losses[0][3] != losses[1][3]
    config = json.loads((tmp_path / "qat" / "config.json").read_text())
    assert config["train"]["qat_start_fraction"] == 0.5


def test_training_says_when_there_is_nothing_to_round(tiny_data_dir, tmp_path):
    log = _train(tiny_data_dir, tmp_path / "run", "--qat-start-fraction", "0.5", "--quant-passthrough-max-numel",
                 "100000")
    assert "qat:nothing to round" in log and "qat:on" not in log


def test_the_grid_describes_itself():
    assert str(RowGrid(31)) == "+-31/rowmax(floor 1/31)"
    assert str(RowGrid(15, 11.5)) == "+-15/11.5sigma" and str(RowGrid(31, floor=False)) == "+-31/rowmax"


def test_a_warm_up_shorter_than_the_runs_states_says_so(tiny_data_dir, tmp_path):
    log = _train(tiny_data_dir, tmp_path / "run", "--qat-start-fraction", "0.75", "--recur-layers", "1",
                 "--recur-count", "2", "--recur-start-fraction", "0.5", "--warmup-steps", "2")
    assert "warmup: 2 steps run 2 of the 3 states the run's passes take" in log
    assert "recurrence:on step:3" in log and "qat:on step:5" in log  # 0.75 of 6 steps: after 4.5


@pytest.mark.slow
def test_compiled_training_with_both_switches_compiles_in_the_warm_up_only(tiny_data_dir, tmp_path):
    """Recurrence at half the run, rounding at three quarters, validations between: the
    warm-up compiles the three states (each one graph), the run itself none."""
    from torch._dynamo.testing import CompileCounter

    from windowgpt_cli.config import apply_overrides, tiny_preset
    from windowgpt_cli.distributed import DistContext
    from windowgpt_cli.train.trainer import RunLog, StopRequests, Trainer, build_setup

    cfg = apply_overrides(tiny_preset(), {
        "data": {"data_path": str(tiny_data_dir)},
        "model": {"recur_layers": (1,), "recur_count": 2},
        "train": {"iterations": 8, "warmup_steps": 3, "val_loss_every": 2, "warmdown_iters": 2,
                  "recur_start_fraction": 0.5, "qat_start_fraction": 0.75}}).resolved()
    setup = build_setup(cfg, DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    counter = CompileCounter()
    torch._dynamo.reset()
    setup.forward = torch.compile(setup.model, backend=counter, dynamic=False, fullgraph=True)
    setup.compiled = True
    log = RunLog(tmp_path, enabled=True, echo=lambda line: None)
    trainer = Trainer(setup, tmp_path, log)
    trainer.warm_up()
    assert counter.frame_count == 3
    result = trainer.run(None, StopRequests())
    assert result.finished and counter.frame_count == 3
    text = (tmp_path / "train.log").read_text()
    assert "recurrence:on step:4" in text and "qat:on step:6" in text
    setup.model.rounding_weights = False
    unrounded = trainer.validate()
    setup.model.rounding_weights = True  # as in training after the switch: validation sees the weights unrounded
    assert trainer.validate() == unrounded and setup.model.rounding_weights and counter.frame_count == 3
