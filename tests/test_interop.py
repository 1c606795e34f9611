"""What windowgpt writes, read by the tools users already have: the export's weights by the
`safetensors` library, and `export --format hf` by Hugging Face transformers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.artifacts.hf import export_hf
from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import OutputRefused
from windowgpt_cli.model.gpt import build_model
from windowgpt_cli.model.state_dict import unbank_state_dict

runner = CliRunner()


def test_the_safetensors_library_reads_an_export_as_written(eval_run_dir: Path, tmp_path: Path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    export(eval_run_dir, tmp_path / "export")
    path = tmp_path / "export" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"  # what transformers' loader asks of a safetensors file
    ckpt = load_checkpoint(eval_run_dir)
    expected = unbank_state_dict(ckpt.weights("ema"), ckpt.config.model.num_layers)
    read = safetensors_torch.load_file(str(path))
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[name], expected[name]) for name in expected)


def _windowgpt_model(run_dir: Path):
    ckpt = load_checkpoint(run_dir)
    model = build_model(ckpt.config.model, torch.device("cpu"), initialize=False)
    model.load_state_dict(ckpt.weights("ema"))
    return model.eval()


@pytest.mark.slow
def test_transformers_loads_the_hf_folder_and_computes_windowgpts_logits(eval_run_dir: Path, tmp_path: Path,
                                                                           monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # transformers copies the model's code there
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(eval_run_dir), "--out", str(out), "--format", "hf", "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    assert config["model_type"] == "windowgpt" and config["windowgpt"]["model"]["num_layers"] == 4
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "modeling_windowgpt.py",
                                               "README.md"}

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    ours = _windowgpt_model(eval_run_dir)
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = hf_model(ids, labels=ids)
        logits = ours.forward_logits(ids)
        expected_loss = ours.token_nll(ids[:, :-1], ids[:, 1:]).mean()
    assert torch.equal(output.logits, logits)
    assert output.loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
    greedy = hf_model.generate(ids[:1, :6], max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert greedy[0, 6].item() == ours.forward_logits(ids[:1, :6])[0, -1].argmax().item()


def test_an_hf_export_replaces_only_its_own_kind(eval_run_dir: Path, tmp_path: Path):
    out = tmp_path / "hf"
    export_hf(eval_run_dir, out)
    export_hf(eval_run_dir, out, weights="last")  # its own folder: replaced
    assert json.loads((out / "config.json").read_text())["windowgpt_export"]["weights"] == "last"
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputRefused):
        export_hf(eval_run_dir, out)
    assert (out / "notes.txt").read_text() == "mine"
    export(eval_run_dir, tmp_path / "export")
    with pytest.raises(OutputRefused):  # a windowgpt export is not an hf folder to replace
        export_hf(eval_run_dir, tmp_path / "export")
