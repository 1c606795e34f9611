"""`windowgpt report ARTIFACT`: a report card for any run, export or .ptz."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from windowgpt_cli.artifacts.export import export
from windowgpt_cli.artifacts.report_card import CARD_MARK, write_report_card
from windowgpt_cli.artifacts.results import save_eval_result
from windowgpt_cli.challenge import BUDGET_BYTES
from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import OutputRefused
from windowgpt_cli.quant.quantize import quantize

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("eval_single_thread")


def test_a_card_for_a_run_an_export_and_a_ptz(eval_run_dir: Path, tmp_path: Path):
    export(eval_run_dir, tmp_path / "export")
    quantize(tmp_path / "export", tmp_path / "model.ptz", device="cpu")
    save_eval_result(tmp_path / "model.ptz", {"mode": "sliding", "val_bpb": 2.5, "val_loss": 4.2, "seq_len": 128,
                                              "stride": 32})

    run_card = write_report_card(eval_run_dir)
    assert run_card["closest_preset"] == "tiny" and run_card["settings_changed"] == {}
    assert (eval_run_dir / "report.md").read_text().startswith(CARD_MARK)
    assert json.loads((eval_run_dir / "report.json").read_text()) == run_card

    result = runner.invoke(app, ["report", str(tmp_path / "model.ptz"), "--json"])
    assert result.exit_code == 0, result.output
    card = json.loads(result.stdout)
    assert card["artifact_kind"] == "ptz" and card["evaluations"]["sliding"]["val_bpb"] == 2.5
    size = card["size"]
    assert size["total_bytes"] == size["file_bytes"] + size["code_bytes"]
    assert size["headroom_bytes"] == BUDGET_BYTES - size["total_bytes"] and size["within_budget"]
    assert card["lineage"]["kind"] == "export"  # what it was quantized from
    markdown = (tmp_path / "model.ptz.report.md").read_text()
    assert "| eval sliding (seq_len 128, stride 32) | 2.500000 |" in markdown and "within the budget" in markdown
    assert size["code_from"] == "model.ptz.json, its quantize report"  # the code quantize counted: the source here
    assert f"The code counted: {size['code_counted']} (from model.ptz.json" in markdown

    export_card = write_report_card(tmp_path / "export")
    assert export_card["artifact_kind"] == "export"
    export(eval_run_dir, tmp_path / "export")  # the card does not make the export another kind of folder


def test_settings_that_differ_are_named_against_the_closest_preset(eval_run_dir: Path):
    config = json.loads((eval_run_dir / "config.json").read_text())
    from windowgpt_cli.artifacts.checkpoint import load_checkpoint, save_checkpoint
    from windowgpt_cli.config import apply_overrides

    ckpt = load_checkpoint(eval_run_dir)
    ckpt.config = apply_overrides(ckpt.config, {"optim": {"matrix_lr": 0.5}})
    save_checkpoint(eval_run_dir / "checkpoint.pt", ckpt)
    card = write_report_card(eval_run_dir)
    assert card["closest_preset"] == "tiny" and config  # the run's own config.json is left as it is
    assert card["settings_changed"] == {"optim.matrix_lr": {"value": 0.5, "preset": 0.03}}
    assert "| optim.matrix_lr | 0.5 | 0.03 |" in (eval_run_dir / "report.md").read_text()


def test_a_users_file_where_the_card_goes_is_refused(eval_run_dir: Path):
    (eval_run_dir / "report.md").write_text("my notes")
    with pytest.raises(OutputRefused) as refused:
        write_report_card(eval_run_dir)
    # a file beside the run, not an option's: the remedy is to move it
    assert str(refused.value).endswith("is not a report card windowgpt wrote; move it away")
    assert (eval_run_dir / "report.md").read_text() == "my notes"
    assert not (eval_run_dir / "report.json").exists()


def test_a_users_picture_where_the_curves_go_is_refused_before_anything_is_written(eval_run_dir: Path):
    pytest.importorskip("matplotlib")
    (eval_run_dir / "metrics.jsonl").write_text("".join(  # so that the card draws the run's curves
        json.dumps({"step": step, "train_loss": 7.0 - step, "train_time_ms": 100.0 * step}) + "\n" for step in (1, 2)))
    (eval_run_dir / "report.png").write_bytes(b"\x89PNG\r\n\x1a\n my picture")
    with pytest.raises(OutputRefused) as refused:
        write_report_card(eval_run_dir)
    assert str(refused.value).endswith("is not a plot windowgpt wrote; move it away")
    assert (eval_run_dir / "report.png").read_bytes().endswith(b"my picture")
    assert not (eval_run_dir / "report.md").exists() and not (eval_run_dir / "report.json").exists()


def test_a_file_where_a_score_would_be_is_not_read_as_one(eval_run_dir: Path, tmp_path: Path):
    export(eval_run_dir, tmp_path / "export")
    (tmp_path / "export" / "eval-sliding.json").write_text('{"mine": 1}\n')
    (tmp_path / "export" / "eval-standard.json").write_text('{"mode": "sliding", "val_bpb": 1.0}\n')  # not its mode
    (tmp_path / "export" / "eval-ttt.json").write_text('{"mode": "ttt", "val_bpb": "low"}\n')
    card = write_report_card(tmp_path / "export")
    assert card["evaluations"] == {}
    assert "| (none saved: run `windowgpt eval`) | | |" in (tmp_path / "export" / "report.md").read_text()
    save_eval_result(tmp_path / "export", {"mode": "standard", "val_bpb": 2.25, "val_loss": 4.0, "seq_len": 128})
    assert write_report_card(tmp_path / "export")["evaluations"]["standard"]["val_bpb"] == 2.25
