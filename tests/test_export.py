"""export and quantize, end to end on a small CPU model, and the one weight loader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from windowgpt_cli.artifacts import weights as model_io, ptz
from windowgpt_cli.storage import tensorfile
from windowgpt_cli.storage.files import sha256_file
from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import ArtifactError, ConfigError
from windowgpt_cli.model.state_dict import unbank_state_dict
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.artifacts.kinds import locate_artifact
from windowgpt_cli.record.codesize import code_bytes
from windowgpt_cli.quant.quantize import quantize, report_path

pytestmark = pytest.mark.usefixtures("quant_single_thread")
WIDE = {"COLUMNS": "200"}
CPU = torch.device("cpu")


def logits_of(artifact: Path) -> torch.Tensor:
    _, model = model_io.build_model(artifact, CPU)
    tokens = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.forward_logits(tokens)


def test_export_then_load_gives_the_checkpoints_logits(quant_run_dir: Path, tmp_path: Path):
    out = tmp_path / "export"
    info = export(quant_run_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "model.safetensors"]
    assert json.loads((out / "export.json").read_text()) == info
    ckpt = load_checkpoint(quant_run_dir)
    expected = unbank_state_dict(ckpt.weights("ema"), ckpt.config.model.num_layers)
    tensors, _ = tensorfile.load(out / "model.safetensors")
    assert list(tensors) == list(expected)
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert info["weights"] == "ema" and info["step"] == 7
    assert info["tokenizer_sha256"] == load_checkpoint(quant_run_dir).tokenizer_sha256
    assert info["source_sha256"] == sha256_file(quant_run_dir / "checkpoint.pt")
    assert info["tensor_count"] == len(expected)
    assert info["parameter_count"] == sum(t.numel() for t in expected.values())

    run, exported = model_io.load_weights(quant_run_dir), model_io.load_weights(out)
    assert (run.kind, exported.kind) == ("run", "export")
    assert exported.sha256 == sha256_file(out / "model.safetensors")
    assert exported.tokenizer_sha256 == info["tokenizer_sha256"]
    assert exported.config.to_dict() == run.config.to_dict()
    assert torch.equal(logits_of(quant_run_dir), logits_of(out))
    assert torch.equal(logits_of(out / "model.safetensors"), logits_of(out))


@pytest.mark.parametrize("which", ["last", "swa"])
def test_export_other_weights(quant_run_dir: Path, tmp_path: Path, which: str):
    info = export(quant_run_dir, tmp_path / which, weights=which)
    ckpt = load_checkpoint(quant_run_dir)
    source = ckpt.model if which == "last" else {k: v / 2 for k, v in ckpt.swa.items()}  # a sum of 2 snapshots
    loaded = model_io.load_weights(tmp_path / which).state_dict
    assert info["weights"] == which
    assert all(torch.allclose(loaded[k], source[k].float()) for k in source)
    assert not torch.equal(loaded["qo_bank"], ckpt.ema["qo_bank"])
    with pytest.raises(ConfigError):
        export(quant_run_dir, tmp_path / "bad", weights="best")


def test_a_path_names_a_run_an_export_or_a_ptz_by_one_rule(tmp_path: Path):
    """artifacts.kinds.locate_artifact, which load_weights and read_artifact (inspect, compare,
    plot, report) share: a folder by the file it holds, a file by its name, any other file a .ptz."""
    run, exported = tmp_path / "run", tmp_path / "export"
    run.mkdir()
    exported.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    (exported / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.ptz").write_bytes(b"")
    assert locate_artifact(run) == locate_artifact(run / "checkpoint.pt") == ("run", run)
    assert locate_artifact(exported) == locate_artifact(exported / "model.safetensors") == ("export", exported)
    assert locate_artifact(tmp_path / "model.ptz") == ("ptz", tmp_path / "model.ptz")
    with pytest.raises(ArtifactError, match="neither a run directory"):
        locate_artifact(tmp_path)
    with pytest.raises(ArtifactError, match="no such file or directory"):
        locate_artifact(exported / "checkpoint.pt")


def test_loader_refuses_what_is_not_an_artifact(tmp_path: Path, quant_run_dir: Path):
    with pytest.raises(ArtifactError, match="neither a run directory"):
        model_io.load_weights(tmp_path)
    with pytest.raises(ArtifactError, match="no such file"):
        model_io.load_weights(tmp_path / "missing.ptz")
    out = tmp_path / "export"
    export(quant_run_dir, out)
    (out / "config.json").unlink()
    with pytest.raises(ArtifactError, match="config.json"):
        model_io.load_weights(out)


@pytest.mark.slow
def test_quantize_writes_the_artifact_and_its_budget_report(quant_run_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "export"
    export(quant_run_dir, out_dir)
    artifact = tmp_path / "model.ptz"
    report = quantize(out_dir, artifact)
    assert json.loads(report_path(artifact).read_text()) == report
    assert report["sha256"] == sha256_file(artifact) and report["model_bytes"] == artifact.stat().st_size
    assert report["code_bytes"] == code_bytes() > 10_000
    assert report["total_bytes"] == report["model_bytes"] + report["code_bytes"]
    assert report["within_budget"] and report["headroom_bytes"] == 16_000_000 - report["total_bytes"]
    groups = report["groups"]
    parameters = json.loads((out_dir / "export.json").read_text())["parameter_count"]
    assert sum(g["params"] for g in groups.values()) == parameters
    assert groups["attn"]["quantized_bytes"] < groups["attn"]["raw_bytes"] / 3  # int6 in int8 bytes vs float32
    assert groups["control"]["tensors"] > 0 and report["schemes"]["int6_rtn"] == 12 and report["schemes"]["int8"] == 1
    assert set(report["timings_s"]) >= {"load", "quantize", "compress", "total"}

    loaded = model_io.load_weights(artifact)
    assert loaded.kind == "ptz" and len(loaded.tokenizer_sha256) == 64
    restored = ptz.load(artifact)
    assert restored.source["sha256"] == sha256_file(out_dir / "model.safetensors")
    deq = unbank_state_dict(loaded.state_dict, loaded.config.model.num_layers)
    assert all(torch.equal(deq[k], v) for k, v in restored.dequantized().items())
    exact, quantized = logits_of(out_dir), logits_of(artifact)
    assert not torch.equal(exact, quantized)
    # Coarse: the reference's smallest int6 step is 1/31, large for these small random weights.
    assert torch.nn.functional.cosine_similarity(exact.flatten(), quantized.flatten(), dim=0) > 0.9


@pytest.mark.slow
def test_quantize_with_gptq_calibrates_and_times_each_phase(quant_run_dir: Path, quant_data_dir: Path, tmp_path: Path):
    artifact = tmp_path / "gptq.ptz"
    report = quantize(quant_run_dir, artifact, gptq=True, data_dir=quant_data_dir, calib_batches=2, device="cpu")
    assert report["gptq"] and report["calib_batches"] == 2 and report["schemes"]["int6_gptq"] == 12
    assert report["timings_s"]["hessians"] > 0 and 0 < report["timings_s"]["gptq"] <= report["timings_s"]["quantize"]
    restored = ptz.load(artifact)
    assert restored.config.quant.use_gptq and restored.config.quant.gptq_calib_samples == 2
    assert restored.tensors["blocks.1.mlp.proj.weight"].method == "gptq"
    with pytest.raises(ConfigError, match="--data"):
        quantize(quant_run_dir, tmp_path / "x.ptz", gptq=True)


@pytest.mark.slow
def test_cli_export_and_quantize_report_and_enforce_the_budget(quant_run_dir: Path, tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(quant_run_dir), "--out", str(tmp_path / "e")], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "parameter_count" in result.output

    artifact = tmp_path / "m.ptz"
    result = runner.invoke(app, ["quantize", str(tmp_path / "e"), "--out", str(artifact)], env=WIDE)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path(artifact).read_text())
    for label in ("attn", "mlp", "embed", "control", "compressed model", "code", "total", "16,000,000"):
        assert label in result.output
    assert f"{report['total_bytes']:,}" in result.output
    # the default, auto, chose one compressor; the header and the report name it
    assert report["compressor_option"] == "auto" and report["compressor"] == "groups"
    assert ptz.compressor_of(artifact.read_bytes()) == report["compressor"]
    assert f"({report['compressor']} by auto," in result.output
    _, model = model_io.build_model(artifact, torch.device("cpu"))  # loads as eval loads it
    assert sum(p.numel() for p in model.parameters()) == json.loads((tmp_path / "e" / "export.json").read_text())[
        "parameter_count"]

    too_small = report["model_bytes"]  # leaves nothing for the code
    result = runner.invoke(app, ["quantize", str(tmp_path / "e"), "--out", str(artifact), "--budget", str(too_small),
                                 "--compressor", "rans", "--json"], env=WIDE)
    assert result.exit_code == 1
    assert artifact.is_file()  # written, then refused
    assert "exceed the budget" in result.output and result.output.count("error:") == 1

    result = runner.invoke(app, ["quantize", str(artifact), "--out", str(tmp_path / "again.ptz")], env=WIDE)
    assert result.exit_code == 1 and "already quantized" in result.output

    result = runner.invoke(app, ["quantize", str(tmp_path / "e"), "--out", str(tmp_path / "z.ptz"),
                                 "--compressor", "zip"], env=WIDE)
    assert result.exit_code == 1 and result.output.count("error:") == 1
    assert "must be one of auto, lzma, rans, brotli, zstd" in result.output
    assert not (tmp_path / "z.ptz").exists()


def test_quantize_settings_reach_the_report_the_table_and_inspect(quant_run_dir: Path, tmp_path: Path):
    """Each group's bits, LQER corrections, round-trip error and compressed bytes, from the
    quantize report, its table, and `inspect` of the .ptz alone."""
    runner = CliRunner()
    artifact = tmp_path / "m.ptz"
    result = runner.invoke(app, ["quantize", str(quant_run_dir), "--out", str(artifact), "--quant-embed-bits", "7",
                                 "--quant-lqer-rank", "2", "--quant-lqer-top-k", "1", "--quant-mlp-clip-sigmas",
                                 "8"], env=WIDE)
    assert result.exit_code == 0, result.output
    report = json.loads(report_path(artifact).read_text())
    groups = report["groups"]
    assert groups["embed"]["bits"] == [7] and sum(g.get("lqer", 0) for g in groups.values()) == 1
    assert all(0 < groups[g]["rel_error"] < 0.5 for g in ("attn", "mlp", "embed"))
    assert report["sections"] and sum(g.get("compressed_bytes", 0) for g in groups.values()) <= report["model_bytes"]
    assert report["schemes"]["int6_rtn_sigma"] > 0 and report["schemes"]["int7"] == 1
    for words in ("rel.", "compressed", "sections", "layout", "7"):
        assert words in result.output
    again = runner.invoke(app, ["inspect", str(artifact), "--json"], env=WIDE)
    described = json.loads(again.stdout)
    for name in ("attn", "mlp", "embed"):
        assert described["groups"][name]["bits"] == groups[name]["bits"]
        assert described["groups"][name]["lqer"] == groups[name]["lqer"]
    assert described["sections"] == report["sections"]
    table = runner.invoke(app, ["inspect", str(artifact)], env=WIDE)
    assert "rel. error" in table.output and "compressed" in table.output and "sections" in table.output


def test_bits_follow_the_clip_range(quant_run_dir: Path, tmp_path: Path):
    """int6 codes within a clip range of 15 span 31 levels: the report and `inspect` say 5 bits
    for the matrices (the embedding stays int8), not the scheme's name."""
    runner = CliRunner()
    artifact = tmp_path / "m.ptz"
    result = runner.invoke(app, ["quantize", str(quant_run_dir), "--out", str(artifact), "--clip-range", "15"],
                           env=WIDE)
    assert result.exit_code == 0, result.output
    groups = json.loads(report_path(artifact).read_text())["groups"]
    described = json.loads(runner.invoke(app, ["inspect", str(artifact), "--json"], env=WIDE).stdout)["groups"]
    for rows in (groups, described):
        assert rows["mlp"]["bits"] == [5] and rows["embed"]["bits"] == [8]
        assert 5 in rows["attn"]["bits"] and 6 not in rows["attn"]["bits"]  # beside small kept tensors
