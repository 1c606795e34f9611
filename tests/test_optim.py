"""Newton-Schulz, Muon, the optimizer table, the schedule and the weight averages."""
import dataclasses

import pytest
import torch

from windowgpt_cli.config import OptimConfig, TrainConfig, tiny_preset
from windowgpt_cli.model.gpt import build_model
from windowgpt_cli.train.optim import WeightAverages, build_optimizers, lr_scale, muon_momentum_at, newton_schulz5


def test_newton_schulz_output_is_close_to_orthogonal():
    g = torch.randn(3, 32, 96)  # wide, batched
    x = newton_schulz5(g, steps=5).float()
    singular = torch.linalg.svdvals(x)
    # The quintic iteration pushes singular values into a band around 1, not exactly onto it.
    assert singular.min() > 0.5 and singular.max() < 1.3
    tall = newton_schulz5(torch.randn(80, 24)).float()
    assert tall.shape == (80, 24)
    s = torch.linalg.svdvals(tall)
    assert s.min() > 0.5 and s.max() < 1.3
    # Orthogonalization keeps the direction: the update correlates with the gradient.
    g2 = torch.randn(40, 40)
    assert (newton_schulz5(g2).float() * g2).sum() > 0.5 * g2.norm() * newton_schulz5(g2).float().norm()


def test_every_parameter_has_exactly_one_optimizer():
    model = build_model(tiny_preset().model, torch.device("cpu"))
    opts = build_optimizers(model, OptimConfig())
    owned = [p for opt in opts.all for g in opt.param_groups for p in g["params"]]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))
    assert {id(p) for p in opts.muon.param_groups[0]["params"]} == {
        id(model.qo_bank), id(model.kv_bank), id(model.mlp_up_bank), id(model.mlp_down_bank)}


def test_untied_head_gets_its_own_adam():
    model = build_model(dataclasses.replace(tiny_preset().model, tie_embeddings=False), torch.device("cpu"))
    opts = build_optimizers(model, OptimConfig())
    assert len(opts.all) == 4
    assert opts.all[-1].param_groups[0]["params"][0] is model.lm_head.weight


def test_muon_step_moves_banks_by_scaled_orthogonal_update():
    model = build_model(tiny_preset().model, torch.device("cpu"))
    opts = build_optimizers(model, OptimConfig(muon_wd=0.0))
    before = model.mlp_up_bank.detach().clone()
    model.mlp_up_bank.grad = torch.randn_like(model.mlp_up_bank)
    opts.muon.step()
    delta = (before - model.mlp_up_bank.detach()) / OptimConfig().matrix_lr
    rows, cols = model.mlp_up_bank.shape[1:]
    expected_scale = max(1.0, rows / cols) ** 0.5
    # Update = scale * NS(g + momentum * g) for a first step: its singular values sit near scale.
    s = torch.linalg.svdvals(delta)
    assert 0.5 * expected_scale < s.mean() < 1.3 * expected_scale


def test_step_based_warmdown_and_wallclock_warmdown():
    t = TrainConfig(iterations=100, warmdown_iters=20)
    assert lr_scale(0, 0.0, t, None) == 1.0
    assert lr_scale(79, 0.0, t, None) == 1.0
    assert lr_scale(80, 0.0, t, None) == 1.0
    assert abs(lr_scale(90, 0.0, t, None) - 0.5) < 1e-12
    # Wallclock: 10 ms per step, 20 warm-down steps = 200 ms before the 1000 ms cap.
    t.warmdown_max_fraction = 1.0
    assert lr_scale(50, 500.0, t, 1000.0) == 1.0
    assert abs(lr_scale(90, 900.0, t, 1000.0) - 0.5) < 1e-12
    assert lr_scale(100, 1000.0, t, 1000.0) == 0.0


def test_muon_momentum_warmup():
    cfg = OptimConfig(muon_momentum_warmup_start=0.9, muon_momentum=0.99, muon_momentum_warmup_steps=10)
    assert muon_momentum_at(0, cfg) == 0.9
    assert abs(muon_momentum_at(5, cfg) - 0.945) < 1e-12
    assert muon_momentum_at(50, cfg) == 0.99


def test_ema_and_swa_average_the_weights():
    model = build_model(tiny_preset().model, torch.device("cpu"))
    avg = WeightAverages(model, ema_decay=0.5, warmup=False)
    start = model.smear.gate.detach().clone()
    with torch.no_grad():
        model.smear.gate.add_(2.0)
    avg.update_ema(model, step=100)
    idx = avg.names.index("smear.gate")
    assert torch.allclose(avg.ema[idx], start + 1.0)
    avg.add_swa_snapshot(model)
    with torch.no_grad():
        model.smear.gate.add_(2.0)
    avg.add_swa_snapshot(model)
    assert avg.swa_count == 2
    assert torch.allclose(avg.swa_state()["smear.gate"] / 2, start + 3.0)


def test_wallclock_warmdown_is_capped_to_a_fraction_of_the_budget():
    t = TrainConfig(iterations=10_000, warmdown_iters=3500, warmdown_max_fraction=0.5)
    # 700 ms per step: 3500 steps would outlast a 600 s budget, so the reference decays from step 0.
    assert lr_scale(10, 7000.0, t, 600_000.0) == 1.0
    assert abs(lr_scale(500, 450_000.0, t, 600_000.0) - 0.5) < 1e-12
    t.warmdown_max_fraction = 1.0
    assert lr_scale(10, 7000.0, t, 600_000.0) < 1.0


def test_ema_warmup_follows_early_weights():
    model = build_model(tiny_preset().model, torch.device("cpu"))
    avg = WeightAverages(model, ema_decay=0.997, warmup=True)
    assert avg.decay_at(0) == 0.1 and avg.decay_at(10_000) == 0.997
    with torch.no_grad():
        model.smear.gate.fill_(1.0)
    for step in range(50):
        avg.update_ema(model, step)
    assert avg.ema[avg.names.index("smear.gate")].min() > 0.99


def test_the_reference_polynomial_is_unchanged_and_polar_express_orthogonalizes_closer():
    from windowgpt_cli.train.optim import NS_COEFFICIENTS, ns_coefficients

    g = torch.randn(4, 48, 32, generator=torch.Generator().manual_seed(0))
    x = g.bfloat16().mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):  # the reference's loop, written out
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    assert torch.equal(newton_schulz5(g), x.mT)
    assert ns_coefficients("reference", 3) == [NS_COEFFICIENTS] * 3
    polar = ns_coefficients("polar_express", 10)
    assert polar[0][0] == pytest.approx(8.28721201814563 / 1.01) and polar[7:] == [(1.875, -1.25, 0.375)] * 3
    # Five steps of each on ill-conditioned matrices: Polar Express lands nearer to orthogonal.
    u, _, v = torch.linalg.svd(torch.randn(48, 32, generator=torch.Generator().manual_seed(1)), full_matrices=False)
    ill = u @ torch.diag(torch.logspace(0, -3, 32)) @ v
    spread = {name: (torch.linalg.svdvals(newton_schulz5(ill, coefficients=name).float()) - 1).abs().max().item()
              for name in ("reference", "polar_express")}
    assert spread["polar_express"] < spread["reference"], spread


def test_a_floor_and_a_fractional_warmdown():
    t = TrainConfig(iterations=100, warmdown_iters=20)
    reference = [lr_scale(s, 10.0 * s, t, None) for s in range(101)]
    t.min_lr_fraction = 0.1
    assert lr_scale(50, 0.0, t, None) == 1.0 and lr_scale(99, 0.0, t, None) == pytest.approx(0.1 + 0.9 * 0.05)
    assert lr_scale(90, 0.0, t, None) == pytest.approx(0.1 + 0.9 * 0.5)
    t.min_lr_fraction, t.warmdown_fraction = 0.0, 0.85  # the last 85 of 100 steps
    assert lr_scale(15, 0.0, t, None) == 1.0 and lr_scale(16, 0.0, t, None) < 1.0
    assert lr_scale(100 - 85 // 2, 0.0, t, None) == pytest.approx((85 // 2) / 85)
    assert lr_scale(500, 750.0, t, 1000.0) == pytest.approx(250 / 850)  # 85% of a 1000 ms budget
    assert lr_scale(100, 100.0, t, 1000.0) == 1.0
    t.warmdown_fraction = 0.0
    assert [lr_scale(s, 10.0 * s, t, None) for s in range(101)] == reference  # the defaults: unchanged


def test_polar_express_and_the_schedule_are_settings_with_bounds():
    from windowgpt_cli.config import RunConfig, apply_overrides, validate
    from windowgpt_cli.errors import ConfigError

    cfg = apply_overrides(RunConfig(), {"optim": {"muon_ns_coefficients": "polar_express"},
                                        "train": {"min_lr_fraction": 0.1, "warmdown_fraction": 0.85}})
    validate(cfg)
    optimizers = build_optimizers(build_model(tiny_preset().model, torch.device("cpu")), cfg.optim)
    assert optimizers.muon.ns_coefficients == "polar_express"
    for bad in ({"optim": {"muon_ns_coefficients": "cubic"}}, {"train": {"min_lr_fraction": 1.5}},
                {"train": {"warmdown_fraction": -0.1}}):
        with pytest.raises(ConfigError):
            validate(apply_overrides(RunConfig(), bad))


def first_muon_update(cfg: OptimConfig, grad: torch.Tensor) -> torch.Tensor:
    """The change of mlp_up_bank by Muon's first step on grad, per unit learning rate."""
    model = build_model(tiny_preset().model, torch.device("cpu"))
    opts = build_optimizers(model, dataclasses.replace(cfg, muon_wd=0.0))
    before = model.mlp_up_bank.detach().clone()
    model.mlp_up_bank.grad = grad.clone()
    opts.muon.step()
    return (before - model.mlp_up_bank.detach()) / cfg.matrix_lr


def test_muon_row_normalize_orthogonalizes_unit_rows_and_is_off_by_default():
    from windowgpt_cli.train.optim import unit_rows

    model = build_model(tiny_preset().model, torch.device("cpu"))
    grad = torch.randn(model.mlp_up_bank.shape, generator=torch.Generator().manual_seed(0))
    rows = torch.logspace(-3, 1, grad.shape[1]).reshape(1, -1, 1)  # rows of very different sizes
    skewed = grad * rows
    cfg, on = OptimConfig(), OptimConfig(muon_row_normalize=True)
    assert not cfg.muon_row_normalize
    scale = max(1.0, grad.shape[1] / grad.shape[2]) ** 0.5
    # The first step's update: NS(g + momentum * g), its rows made unit first with the setting.
    nesterov = skewed.bfloat16().add(skewed.bfloat16(), alpha=cfg.muon_momentum)  # its momentum is the gradient
    expected = newton_schulz5(unit_rows(nesterov)).float() * scale
    assert torch.allclose(first_muon_update(on, skewed), expected, rtol=1e-3, atol=1e-5)
    assert torch.allclose(first_muon_update(cfg, skewed), newton_schulz5(nesterov).float() * scale,
                          rtol=1e-3, atol=1e-5)
    # Rows scaled apart give nearly the update of the unscaled gradient only with the setting.
    difference = {name: (first_muon_update(c, skewed) - first_muon_update(c, grad)).norm().item()
                  for name, c in (("on", on), ("off", cfg))}
    reference_norm = first_muon_update(cfg, grad).norm().item()
    assert difference["on"] < 0.05 * reference_norm < difference["off"], difference
    norms = unit_rows(skewed.bfloat16()).float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)


def test_embed_wd_decays_the_token_tables_and_defaults_to_adam_wd():
    from windowgpt_cli.config import RunConfig, apply_overrides, validate
    from windowgpt_cli.errors import ConfigError

    def decayed(cfg: OptimConfig) -> tuple[float, float]:
        """How much one step with zero gradients shrinks the embedding and the skip weights."""
        model = build_model(tiny_preset().model, torch.device("cpu"))
        opts = build_optimizers(model, cfg)
        tables = (model.tok_emb.weight, model.skip_weights)
        before = [t.detach().clone() for t in tables]
        for t in tables:
            t.grad = torch.zeros_like(t)
        opts.step_adams()
        return tuple(1 - (t.detach() / b)[b != 0].mean().item() for t, b in zip(tables, before))

    reference = decayed(OptimConfig(adam_wd=0.04))
    assert reference[0] == pytest.approx(0.04 * OptimConfig().tied_embed_lr, rel=1e-4)
    assert reference[1] == pytest.approx(0.04 * OptimConfig().scalar_lr, rel=1e-4)
    own = decayed(OptimConfig(adam_wd=0.04, embed_wd=0.5))
    assert own[0] == pytest.approx(0.5 * OptimConfig().tied_embed_lr, rel=1e-4) and own[1] == reference[1]
    for good in (-1.0, 0.0, 0.085):
        validate(apply_overrides(RunConfig(), {"optim": {"embed_wd": good}}))
    for bad in (-0.5, -2.0):
        with pytest.raises(ConfigError, match="embed_wd"):
            validate(apply_overrides(RunConfig(), {"optim": {"embed_wd": bad}}))
