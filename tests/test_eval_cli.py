"""`windowgpt eval` and `windowgpt eval-ttt`: the numbers of the plain functions, JSON and
tables, artifacts of every kind, and one-line errors."""
from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from windowgpt_cli.artifacts import ptz
from windowgpt_cli.cli.app import app
from windowgpt_cli.config import tiny_preset
from windowgpt_cli.eval.scoring import CPU_BATCH_WINDOWS, evaluate_sliding, evaluate_standard
from windowgpt_cli.eval.ttt import evaluate_ttt
from windowgpt_cli.model.gpt import build_model
from windowgpt_cli.model.state_dict import rebank_state_dict
from windowgpt_cli.cli import evaluate as evaluate_stage
from windowgpt_cli.quant.quantize import quantize

pytestmark = pytest.mark.usefixtures("eval_single_thread")

WIDE = {"COLUMNS": "200"}
CPU = torch.device("cpu")
TINY = tiny_preset()  # the run's saved settings: seq_len 128, stride 32, batch 16
JSON_KEYS = {"mode", "val_loss", "val_bpb", "tokens", "bytes", "seconds", "tokens_per_second", "seq_len", "stride",
             "batch_seqs", "artifact", "artifact_kind", "artifact_sha256"}


def run_cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


def run_json(*args) -> dict:
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def truncated(tokens: torch.Tensor, seq_len: int = 128) -> torch.Tensor:
    return tokens[: ((tokens.numel() - 1) // seq_len) * seq_len + 1]


def test_eval_defaults_to_the_runs_sliding_settings(eval_run_dir, eval_data_dir, eval_model, eval_val_tokens,
                                                   eval_luts):
    out = run_json("eval", eval_run_dir, "--data", eval_data_dir)
    assert JSON_KEYS <= set(out)
    assert (out["mode"], out["seq_len"], out["stride"]) == ("sliding", TINY.eval.eval_seq_len, TINY.eval.eval_stride)
    assert out["artifact_kind"] == "run" and len(out["artifact_sha256"]) == 64
    want = evaluate_sliding(eval_model, truncated(eval_val_tokens), eval_luts, seq_len=128, stride=32, batch_seqs=16,
                            device=CPU)
    assert (out["tokens"], out["bytes"]) == (want.tokens, want.bytes)
    assert out["val_bpb"] == pytest.approx(want.val_bpb, rel=1e-9)


def test_eval_with_the_sequence_length_as_stride_is_standard(eval_run_dir, eval_data_dir, eval_model,
                                                             eval_val_tokens, eval_luts):
    out = run_json("eval", eval_run_dir, "--data", eval_data_dir, "--stride", 128, "--batch-seqs", 3)
    want = evaluate_standard(eval_model, truncated(eval_val_tokens), eval_luts, seq_len=128, batch_tokens=3 * 128,
                             device=CPU)
    assert out["mode"] == "standard" and out["tokens"] == want.tokens == 4 * 128
    assert out["val_bpb"] == pytest.approx(want.val_bpb, rel=1e-9)
    assert run_json("eval", eval_run_dir, "--data", eval_data_dir, "--stride", 0)["val_bpb"] == \
        pytest.approx(want.val_bpb, rel=1e-6)


def test_eval_score_once_counts_each_target_once(eval_run_dir, eval_data_dir):
    out = run_json("eval", eval_run_dir, "--data", eval_data_dir, "--score-once")
    timings = out["timings_s"]  # the command's phases, scoring's own beside them
    assert {"start", "load", "tokens", "scoring", "other", "total"} <= set(timings)
    assert timings["scoring"] == pytest.approx(out["seconds"], abs=1e-3)
    assert {"scorer_setup", "first_batch"} <= set(out["scoring_timings_s"])
    assert out["tokens"] == 4 * 128 and out["score_once"] is True


def test_eval_prints_a_table(eval_run_dir, eval_data_dir):
    result = run_cli("eval", eval_run_dir, "--data", eval_data_dir, "--seq-len", 64, "--stride", 16)
    assert result.exit_code == 0, result.output
    assert "val_bpb" in result.stdout and "sliding" in result.stdout and "64 / 16" in result.stdout
    assert f"windows per batch {TINY.eval.eval_batch_seqs}" in " ".join(result.stdout.replace("│", " ").split())


@pytest.mark.slow
def test_ptz_scores_as_its_dequantized_weights(eval_run_dir, eval_data_dir, eval_val_tokens, eval_luts, tmp_path):
    artifact = tmp_path / "model.ptz"
    quantize(eval_run_dir, artifact, device="cpu")
    model = build_model(TINY.model, CPU)
    loaded = ptz.load(artifact)
    model.load_state_dict(rebank_state_dict(loaded.dequantized(), TINY.model.num_layers), strict=True)
    want = evaluate_sliding(model, truncated(eval_val_tokens), eval_luts, seq_len=128, stride=32, batch_seqs=16,
                            device=CPU)
    out = run_json("eval", artifact, "--data", eval_data_dir)
    assert out["artifact_kind"] == "ptz"
    assert out["val_bpb"] == pytest.approx(want.val_bpb, rel=1e-9)
    assert out["val_bpb"] != run_json("eval", eval_run_dir, "--data", eval_data_dir)["val_bpb"]


def test_eval_ttt_reports_parameters_chunks_and_results(eval_run_dir, eval_data_dir, eval_model, eval_val_tokens,
                                                        eval_luts):
    args = ("eval-ttt", eval_run_dir, "--data", eval_data_dir, "--ttt-chunk-tokens", 256, "--ttt-epochs", 2,
            "--ttt-batch-seqs", 2, "--ttt-lr", 0.01, "--batch-seqs", 8)
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mode"] == "ttt" and len(out["per_chunk"]) == 2
    assert out["ttt"]["ttt_chunk_tokens"] == 256 and out["ttt"]["ttt_freeze_bank_slices"] is True
    assert sum(c["tokens"] for c in out["per_chunk"]) == out["tokens"]
    # The run's freeze_blocks=1: block 0's scalars and (by default) its bank slices.
    m = eval_model
    scalars = sum(p.numel() for name, p in m.named_parameters() if name.startswith("blocks.0."))
    slices = 2 * m.qo_bank[0].numel() + 2 * m.kv_bank[0].numel() + m.mlp_up_bank[0].numel() \
        + m.mlp_down_bank[0].numel()
    assert f"frozen={scalars + slices}" in result.stderr
    ttt = TINY.ttt.__class__(**{**out["ttt"]})
    want = evaluate_ttt(m, truncated(eval_val_tokens), eval_luts, ttt, seq_len=128, stride=32, batch_seqs=8,
                        device=CPU)
    assert out["val_bpb"] == pytest.approx(want.val_bpb, rel=1e-9)
    # One chunk trained on, one step per epoch: eager, then captured and replayed.
    assert out["ttt"]["ttt_cuda_graphs"] is True
    assert out["ttt_steps"] == {"eager": 1, "captured": 1, "replayed": 1}
    eager = json.loads(run_cli(*args, "--no-ttt-cuda-graphs", "--json").stdout)
    assert eager["ttt"]["ttt_cuda_graphs"] is False and eager["ttt_steps"] == {"eager": 2, "captured": 0, "replayed": 0}
    assert eager["val_bpb"] == out["val_bpb"]

    reference_freezing = run_cli(*args, "--no-ttt-freeze-bank-slices")
    assert reference_freezing.exit_code == 0, reference_freezing.output
    assert f"ttt_sliding:params unfrozen={sum(p.numel() for p in m.parameters()) - scalars} frozen={scalars}" \
        in reference_freezing.stdout
    assert "val_bpb" in reference_freezing.stdout


# --- One-line errors ------------------------------------------------------------------------

def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_data_without_validation_shards(eval_run_dir, eval_data_dir):
    for shard in eval_data_dir.glob("fineweb_val_*.bin"):
        shard.unlink()
    assert_one_line_error(run_cli("eval", eval_run_dir, "--data", eval_data_dir), "missing, but manifest.json lists it")
    assert_one_line_error(run_cli("eval-ttt", eval_run_dir, "--data", eval_data_dir), "fineweb_val_000000.bin")


def _runs_out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")


@pytest.mark.parametrize("stage,scorer,remedy", [
    ("eval", "evaluate_sliding", "lower --batch-seqs"),
    ("eval-ttt", "evaluate_ttt", "lower --ttt-batch-seqs or --batch-seqs"),
    ("eval-ttt --method lora", "evaluate_lora_ttt", "lower --ttt-lora-batch-docs"),
])
def test_running_out_of_memory_is_one_line_with_what_to_lower(eval_run_dir, eval_data_dir, monkeypatch, stage,
                                                              scorer, remedy):
    from windowgpt_cli.eval import evaluate

    monkeypatch.setattr(evaluate, scorer, _runs_out_of_memory)
    result = run_cli(*stage.split(), eval_run_dir, "--data", eval_data_dir)
    assert_one_line_error(result, "cpu ran out of memory while scoring",
                          "(CUDA out of memory. Tried to allocate 2.00 GiB)", remedy)


@pytest.mark.parametrize("module,function,args,message", [
    ("windowgpt_cli.quant.quantize", "quantize_state_dict", ["quantize", "{run}", "--out", "{tmp}/m.ptz"],
     "cpu ran out of memory while quantizing"),
    ("windowgpt_cli.generate.text", "generate", ["generate", "{run}", "--tokenizer", "{tok}", "--prompt", "Once"],
     "cpu ran out of memory while generating"),
])
def test_quantize_and_generate_out_of_memory_are_one_line(eval_run_dir, eval_tokenizer, tmp_path, monkeypatch, module,
                                                          function, args, message):
    import importlib

    monkeypatch.setattr(importlib.import_module(module), function, _runs_out_of_memory)
    result = run_cli(*[a.format(run=eval_run_dir, tok=eval_tokenizer, tmp=tmp_path) for a in args])
    assert_one_line_error(result, message, "(CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert not (tmp_path / "m.ptz").exists()


def test_data_without_a_manifest_says_how_to_make_one(eval_run_dir, eval_data_dir):
    (eval_data_dir / "manifest.json").unlink()
    for stage in ("eval", "eval-ttt"):
        assert_one_line_error(run_cli(stage, eval_run_dir, "--data", eval_data_dir), "no manifest.json",
                              "windowgpt prepare")


def test_tokenizer_other_than_the_runs(eval_run_dir, eval_data_dir, tmp_path):
    other = tmp_path / "other.model"
    shutil.copyfile(eval_data_dir / "tokenizer.model", other)
    with open(other, "ab") as f:
        f.write(b"\0")
    assert_one_line_error(run_cli("eval", eval_run_dir, "--data", eval_data_dir, "--tokenizer", other),
                          "sha256", str(other))
    assert_one_line_error(run_cli("eval-ttt", eval_run_dir, "--data", eval_data_dir, "--tokenizer", other), "sha256")


def test_stride_longer_than_the_sequence(eval_run_dir, eval_data_dir):
    assert_one_line_error(run_cli("eval", eval_run_dir, "--data", eval_data_dir, "--stride", 129), "--stride 129")
    assert_one_line_error(run_cli("eval-ttt", eval_run_dir, "--data", eval_data_dir, "--stride", 200), "--stride")
    assert_one_line_error(run_cli("eval-ttt", eval_run_dir, "--data", eval_data_dir, "--stride", 0), "--stride")


def test_batch_of_zero_fits_itself_and_a_negative_batch_is_an_error(eval_run_dir, eval_data_dir):
    given = run_json("eval", eval_run_dir, "--data", eval_data_dir, "--batch-seqs", 5)
    fitted = run_json("eval", eval_run_dir, "--data", eval_data_dir, "--batch-seqs", 0)
    # the CPU's batch, evened out over the batches it takes
    assert given["batch_seqs"] == 5 and CPU_BATCH_WINDOWS // 2 < fitted["batch_seqs"] <= CPU_BATCH_WINDOWS
    assert (fitted["tokens"], fitted["bytes"]) == (given["tokens"], given["bytes"])
    assert fitted["val_bpb"] == pytest.approx(given["val_bpb"], rel=1e-6)
    assert_one_line_error(run_cli("eval", eval_run_dir, "--data", eval_data_dir, "--batch-seqs", -1),
                          "--batch-seqs -1")
    assert_one_line_error(run_cli("eval-ttt", eval_run_dir, "--data", eval_data_dir, "--batch-seqs", -2),
                          "--batch-seqs -2")


def test_fused_kernels_without_cuda(eval_run_dir, eval_data_dir):
    """--fused asks for the CUDA kernels: on the CPU it is a one-line error, not a fallback."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for stage in ("eval", "eval-ttt"):
        assert_one_line_error(run_cli(stage, eval_run_dir, "--data", eval_data_dir, "--fused"), "--no-fused")


def test_unknown_artifact(eval_data_dir, tmp_path):
    assert_one_line_error(run_cli("eval", tmp_path / "missing", "--data", eval_data_dir), "missing")
    not_a_model = tmp_path / "notes.ptz"
    not_a_model.write_bytes(b"hello")
    assert_one_line_error(run_cli("eval", not_a_model, "--data", eval_data_dir), "notes.ptz")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    assert_one_line_error(run_cli("eval-ttt", empty_dir, "--data", eval_data_dir), "empty")


@pytest.mark.parametrize("compiling", [True, False])
def test_the_progress_bar_says_compiling_until_the_first_batch(monkeypatch, compiling):
    out = io.StringIO()
    monkeypatch.setattr(evaluate_stage, "err_console", Console(file=out, force_terminal=True, width=100))
    with evaluate_stage.batch_progress("eval", compiling) as update:
        before_first_batch = out.getvalue()
        update(1, 4)
    after = out.getvalue()[len(before_first_batch):]
    assert ("eval (compiling)" in before_first_batch) == compiling
    assert "eval" in after and "1/4" in after and "compiling" not in after


def test_a_tokenizer_without_byte_fallback_is_reported_beside_the_score(eval_run_dir, eval_data_dir):
    """The test tokenizer (the shared FineWeb one) lacks byte fallback: every stage that
    scores bits per byte says so, on stderr and in its record."""
    result = run_cli("eval", eval_run_dir, "--data", eval_data_dir, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokenizer_byte_fallback"] is False
    assert "has no byte fallback" in result.stderr and "too low" in result.stderr


@pytest.mark.slow
def test_eval_ttt_prints_its_log_above_its_bar_never_on_its_line(eval_run_dir, quant_data_dir):
    """In a terminal (a pseudo-terminal here), each log line has a line of its own."""
    import os
    import pty
    import re
    import sys

    captured = bytearray()

    def read(fd):
        data = os.read(fd, 4096)
        captured.extend(data)
        return data

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "120"
    try:
        status = pty.spawn([sys.executable, "-m", "windowgpt_cli", "eval-ttt", str(eval_run_dir), "--data",
                            str(quant_data_dir), "--ttt-epochs", "1"], read)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    assert os.waitstatus_to_exitcode(status) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", captured.decode(errors="replace"))
    pieces = re.split(r"[\r\n]", text)
    assert any("ttt_sliding:start" in p for p in pieces) and any("ttt ━" in p for p in pieces)
    assert not [p for p in pieces if "ttt ━" in p and "ttt_sliding" in p]
