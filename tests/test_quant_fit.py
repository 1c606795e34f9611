"""Fitting an artifact into its budget (`quant_fit_budget`): the cheapest codes of +-1 go to zero."""
from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import torch

from windowgpt_cli.artifacts.quantized import QuantizedTensor
from windowgpt_cli.config import RunConfig, frontier_preset
from windowgpt_cli.quant.fit import Candidates, entropy_bits, fit_to_budget
from windowgpt_cli.quant.schemes import QuantPlan, quantize_tensor

PLAN = QuantPlan(passthrough_max_numel=100, mlp_clip_sigmas=6.0, attn_clip_sigmas=6.0, embed_bits=7,
                 gates_int8=True)


def _quantized(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedTensor]]:
    g = torch.Generator().manual_seed(seed)
    sd = {name: torch.randn(64, 96, generator=g) * 0.05 for name in
          ("blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight", "tok_emb.weight")}
    sd["skip_weights"] = torch.randn(2, 64, generator=g)  # a gate: int8 rows, never zeroed
    return sd, {name: quantize_tensor(name, t, PLAN) for name, t in sd.items()}


def _lzma(tensors: dict[str, QuantizedTensor]) -> bytes:
    return lzma.compress(b"".join(qt.values.numpy().tobytes() for qt in tensors.values()))


def _cost(sd, tensors, name, flat):
    """The squared error zeroing one code adds, computed directly."""
    w, r = sd[name].flatten()[flat], tensors[name].dequantize().flatten()[flat]
    return float(w.pow(2) - (w - r).pow(2))


def test_candidates_are_the_codes_of_one_cheapest_first_and_leave_gates_alone():
    sd, tensors = _quantized()
    candidates = Candidates.collect(sd, tensors, None)
    assert set(candidates.names) == {"blocks.0.attn.c_q.weight", "blocks.0.mlp.fc.weight", "tok_emb.weight"}
    ones = sum(int((tensors[n].values.abs() == 1).sum()) for n in candidates.names)
    assert len(candidates) == ones > 0
    costs = [_cost(sd, tensors, candidates.names[int(t)], int(i))
             for t, i in zip(candidates.tensor[:200], candidates.index[:200])]
    assert costs == sorted(costs)
    last = candidates.names[int(candidates.tensor[-1])]
    assert costs[0] < _cost(sd, tensors, last, int(candidates.index[-1]))


def test_a_hessian_ranks_a_silent_inputs_codes_first():
    sd, tensors = _quantized()
    name = "blocks.0.mlp.fc.weight"
    energy = torch.ones(96)
    energy[7] = 0.0  # an input never seen: its weights cost nothing to lose
    candidates = Candidates.collect(sd, {name: tensors[name]}, {(name,): torch.diag(energy)})
    silent = int((tensors[name].values[:, 7].abs() == 1).sum())
    assert silent > 0
    assert set((candidates.index[:silent] % 96).tolist()) == {7}


def test_the_entropy_estimate_grows_with_each_code_zeroed_and_finds_the_fewest():
    sd, tensors = _quantized()
    candidates = Candidates.collect(sd, tensors, None)
    assert candidates.bits_saved(0) == 0.0
    saved = [candidates.bits_saved(k) for k in range(0, len(candidates), len(candidates) // 8)]
    assert saved == sorted(saved) and saved[-1] > 0
    wanted = saved[3]
    count = candidates.count_for(wanted)
    assert candidates.bits_saved(count) >= wanted > candidates.bits_saved(count - 1)
    hist = torch.tensor([0, 3, 1])
    assert entropy_bits(hist) == pytest.approx(4 * (-(0.75 * torch.log2(torch.tensor(0.75))) -
                                                    0.25 * torch.log2(torch.tensor(0.25))).item())


def test_fitting_zeroes_only_the_cheapest_codes_of_one_until_it_fits():
    sd, tensors = _quantized()
    before = len(_lzma(tensors))
    allowed = int(before * 0.93)
    fitted, data, record = fit_to_budget(sd, tensors, None, _lzma, allowed)
    assert len(data) == len(_lzma(fitted)) <= allowed < before
    assert record["fitted"] and record["bytes_before"] == before and record["bytes_after"] == len(data)
    assert 1 <= record["rounds"] <= 6
    candidates = Candidates.collect(sd, tensors, None)
    zeroed = set()
    for name in tensors:
        changed = (fitted[name].values != tensors[name].values).flatten()
        assert (fitted[name].values.flatten()[changed] == 0).all()
        assert (tensors[name].values.flatten()[changed].abs() == 1).all()
        zeroed |= {(name, int(i)) for i in changed.nonzero().flatten()}
    assert torch.equal(fitted["skip_weights"].values, tensors["skip_weights"].values)
    assert len(zeroed) == record["zeroed_codes"]
    expected = {(candidates.names[int(t)], int(i)) for t, i in
                zip(candidates.tensor[:len(zeroed)], candidates.index[:len(zeroed)])}
    assert zeroed == expected  # a prefix of the cheapest, nothing else
    assert all(torch.equal(fitted[n].scale, tensors[n].scale) for n in tensors)


def test_an_artifact_within_its_budget_is_left_as_it_is_and_an_impossible_one_says_so():
    sd, tensors = _quantized()
    size = len(_lzma(tensors))
    same, data, record = fit_to_budget(sd, tensors, None, _lzma, size)
    assert same is tensors and len(data) == size and record["rounds"] == 0 and record["fitted"]
    fitted, data, record = fit_to_budget(sd, tensors, None, _lzma, 100)
    assert not record["fitted"] and len(data) > 100
    for name in ("blocks.0.attn.c_q.weight", "tok_emb.weight"):
        assert not (fitted[name].values.abs() == 1).any()  # every candidate given up, nothing more


def test_fitting_is_off_by_default_and_on_in_the_frontier_preset():
    assert RunConfig().quant.quant_fit_budget is False
    assert frontier_preset().quant.quant_fit_budget is True


@pytest.mark.slow
def test_quantize_fits_a_run_into_a_budget_it_would_exceed(tiny_run_dir: Path, tiny_data_dir: Path, tmp_path: Path,
                                                            quant_single_thread):
    from typer.testing import CliRunner

    from windowgpt_cli.cli.app import app
    from windowgpt_cli.quant.quantize import quantize

    plain = quantize(tiny_run_dir, tmp_path / "plain.ptz", gptq=False, device="cpu", compressor="lzma")
    assert plain["fit"] is None and plain["within_budget"]
    budget = plain["total_bytes"] - 3000
    runner = CliRunner()
    over = runner.invoke(app, ["quantize", str(tiny_run_dir), "--out", str(tmp_path / "over.ptz"), "--no-gptq",
                               "--device", "cpu", "--compressor", "lzma", "--budget", str(budget)])
    assert over.exit_code == 1 and "exceed the budget" in over.output
    result = runner.invoke(app, ["quantize", str(tiny_run_dir), "--out", str(tmp_path / "fit.ptz"), "--no-gptq",
                                 "--device", "cpu", "--compressor", "lzma", "--budget", str(budget),
                                 "--quant-fit-budget"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "fit.ptz.json").read_text())
    assert report["within_budget"] and report["total_bytes"] <= budget
    assert report["model_bytes"] == (tmp_path / "fit.ptz").stat().st_size
    fit = report["fit"]
    assert fit["fitted"] and fit["zeroed_codes"] > 0 and fit["allowed_bytes"] == budget - report["code_bytes"]
    assert f"fit: zeroed {fit['zeroed_codes']:,} codes of +-1" in result.output
    assert "the code counted is its source" in result.output  # run from source, not a packed archive
    # The cost shows in the round trip's error, a little, and the artifact records the setting.
    assert report["groups"]["mlp"]["rel_error"] >= plain["groups"]["mlp"]["rel_error"]
    from windowgpt_cli.artifacts import ptz
    assert ptz.load(tmp_path / "fit.ptz").config.quant.quant_fit_budget is True
    # It scores as any .ptz does, a little worse than the artifact it was fitted from.
    from windowgpt_cli.eval.evaluate import evaluate_artifact
    scores = [evaluate_artifact(tmp_path / name, tiny_data_dir, device="cpu").record["val_bpb"]
              for name in ("plain.ptz", "fit.ptz")]
    assert scores[0] < scores[1] < scores[0] + 0.05
