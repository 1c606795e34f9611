"""`inspect`, `compare` and `plot` on real artifacts; `.ptz` bytes that depend on content
only; eval results saved beside the artifact; training's samples and metric loggers."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
from typer.testing import CliRunner

from windowgpt_cli.artifacts import ptz
from windowgpt_cli.storage.files import sha256_file
from windowgpt_cli.cli.app import app
from windowgpt_cli.config import apply_overrides, tiny_preset
from windowgpt_cli.errors import ConfigError
from windowgpt_cli.train.metric_sinks import open_sink
from windowgpt_cli.artifacts.compare import compare
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.artifacts.inspect import inspect_artifact
from windowgpt_cli.artifacts.curves import plot_runs
from windowgpt_cli.quant.quantize import quantize
from windowgpt_cli.train.run import train
from windowgpt_cli.train.trainer import RunLog

pytestmark = pytest.mark.usefixtures("eval_single_thread")
WIDE = {"COLUMNS": "200"}


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


@pytest.fixture
def three_kinds(eval_run_dir, tmp_path):
    """A run, its export and the export's .ptz."""
    export(eval_run_dir, tmp_path / "export")
    quantize(tmp_path / "export", tmp_path / "model.ptz", gptq=False, device="cpu")
    return eval_run_dir, tmp_path / "export", tmp_path / "model.ptz"


@pytest.mark.slow
def test_inspect_describes_a_run_an_export_and_a_ptz(three_kinds):
    run, exported, packed = three_kinds
    records = [inspect_artifact(p) for p in three_kinds]
    assert [r["kind"] for r in records] == ["run", "export", "ptz"]
    assert len({r["parameters"] for r in records}) == 1 and records[0]["parameters"] > 0
    assert [r["sha256"] for r in records] == [sha256_file(run / "checkpoint.pt"),
                                             sha256_file(exported / "model.safetensors"), sha256_file(packed)]
    assert records[0]["step"] == records[1]["step"] == 1
    assert records[0]["config_changes"]["model.num_layers"] == {"value": 4, "default": 11}
    ptz_record = records[2]
    assert ptz_record["compressor"] == "groups" and ptz_record["format_version"] == ptz.FORMAT_VERSION
    assert ptz_record["total_bytes"] == ptz_record["file_bytes"] + ptz_record["code_bytes"]
    assert ptz_record["within_budget"] is True
    schemes = {s for g in ptz_record["groups"].values() for s in g["schemes"]}
    assert {"int6_rtn", "int8", "passthrough"} <= schemes
    grouped_bytes = sum(g["bytes"] for g in ptz_record["groups"].values())
    assert grouped_bytes < sum(g["bytes"] for g in records[0]["groups"].values())
    lineage = ptz_record["lineage"]
    assert lineage["kind"] == "export" and lineage["sha256"] == records[1]["sha256"]
    assert lineage["run_sha256"] == records[0]["sha256"] and lineage["weights"] == "ema"
    assert ptz_record["run_dir"] == str(run)  # found through the paths in model.ptz.json
    for path in three_kinds:
        shown = cli("inspect", path)
        assert shown.exit_code == 0 and "sha256" in shown.stdout and "num_layers" in shown.stdout
        assert json.loads(cli("inspect", path, "--json").stdout)["kind"] in ("run", "export", "ptz")


def test_inspect_refuses_what_is_no_artifact_in_one_line(tmp_path):
    result = cli("inspect", tmp_path)
    assert result.exit_code == 1 and "neither a run directory" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_a_ptz_budget_counts_the_code_its_quantize_report_counted_or_the_code_given(three_kinds, tmp_path):
    from windowgpt_cli.record.archive import pack
    from windowgpt_cli.record.codesize import code_bytes

    _, _, model = three_kinds
    report_path = model.with_name(model.name + ".json")
    report = json.loads(report_path.read_text())
    assert inspect_artifact(model)["code_bytes"] == report["code_bytes"] == code_bytes()  # quantized from source
    # A .ptz quantized from packed code: its report counted the archive, and so does inspect.
    report.update(code_bytes=132_000, code_counted="zipapp of 3 files, 94 modules in one lzma stream")
    report_path.write_text(json.dumps(report))
    record = inspect_artifact(model)
    assert record["code_bytes"] == 132_000 and record["total_bytes"] == record["file_bytes"] + 132_000
    assert record["code_counted"] == report["code_counted"] and record["code_from"].startswith("model.ptz.json")
    shown = cli("inspect", model)
    assert "code counted" in shown.stdout and "132,000" in shown.stdout  # (the table wraps long values)
    assert json.loads(cli("inspect", model, "--json").stdout)["code_bytes"] == 132_000
    # --code counts the archive given, whatever the report says.
    count = pack(tmp_path / "code.pyz", strip=True, lzma=True)
    record = inspect_artifact(model, code=tmp_path / "code.pyz")
    assert record["code_bytes"] == count.bytes and record["code_counted"] == count.form
    assert record["code_from"] == str(tmp_path / "code.pyz")
    # A report of another .ptz (the file replaced since) is not this one's: the running code is counted.
    report_path.write_text(json.dumps({**report, "sha256": "0" * 64}))
    record = inspect_artifact(model)
    assert record["code_bytes"] == code_bytes() and record["code_from"] == "this windowgpt's record code"


@pytest.mark.slow
def test_inspect_describes_packed_code_and_no_stage_takes_it_for_a_model(three_kinds, tmp_path, eval_data_dir):
    from windowgpt_cli.record.archive import pack

    run, _, model = three_kinds
    count = pack(tmp_path / "code.pyz", lzma=True)
    record = inspect_artifact(tmp_path / "code.pyz")
    assert record == {"artifact": str(tmp_path / "code.pyz"), "kind": "packed code", "sha256": count.sha256,
                      "file_bytes": count.bytes, "form": count.form, "files": count.files,
                      "source_bytes": count.source_bytes}
    shown = cli("inspect", tmp_path / "code.pyz")
    assert shown.exit_code == 0 and "(packed code)" in shown.stdout and "lzma stream" in shown.stdout
    for args in (["inspect", run, "--code", tmp_path / "code.pyz"],
                 ["inspect", tmp_path / "code.pyz", "--code", tmp_path / "code.pyz"],
                 ["inspect", model, "--code", run / "config.json"],
                 ["inspect", model, "--code", tmp_path / "missing.pyz"],
                 ["report", tmp_path / "code.pyz"],
                 ["eval", tmp_path / "code.pyz", "--data", eval_data_dir]):
        result = cli(*args)
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, (args, result.output)
        assert "Traceback" not in result.output
    assert "is a run, not a .ptz" in cli("inspect", run, "--code", tmp_path / "code.pyz").output
    assert "not packed code" in cli("inspect", model, "--code", run / "config.json").output
    assert "it is packed code" in cli("eval", tmp_path / "code.pyz", "--data", eval_data_dir).output
    assert "packed code, not a model" in cli("report", tmp_path / "code.pyz").output
    assert not list(tmp_path.glob("code.pyz.report.*"))


@pytest.mark.slow
def test_same_weights_and_settings_give_the_same_ptz_bytes_anywhere(three_kinds, tmp_path):
    _, exported, packed = three_kinds
    elsewhere = tmp_path / "elsewhere" / "deeper" / "copy"
    shutil.copytree(exported, elsewhere)
    quantize(elsewhere, tmp_path / "other.ptz", gptq=False, device="cpu")
    assert (tmp_path / "other.ptz").read_bytes() == packed.read_bytes()
    artifact = ptz.load(packed)
    assert str(tmp_path) not in json.dumps(artifact.source) and artifact.config.data.data_path == ""
    reports = [json.loads(p.with_name(p.name + ".json").read_text()) for p in (packed, tmp_path / "other.ptz")]
    assert reports[0]["source"]["path"] != reports[1]["source"]["path"]  # paths stay in the reports


@pytest.mark.slow
def test_eval_results_are_saved_beside_the_artifact_and_found(three_kinds, eval_data_dir):
    _, _, packed = three_kinds
    result = cli("eval", packed, "--data", eval_data_dir, "--json")
    assert result.exit_code == 0, result.output
    saved = packed.with_name("model.ptz.eval-sliding.json")
    assert json.loads(saved.read_text()) == json.loads(result.stdout)
    found = inspect_artifact(packed)["evals"]
    assert found["sliding"]["val_bpb"] == json.loads(result.stdout)["val_bpb"]
    assert compare([packed])["columns"][0]["sliding_bpb"] == found["sliding"]["val_bpb"]


# --- Real training runs: samples, compare, plot ------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tiny_data_dir, tmp_path_factory):
    """Two short tiny runs that differ in matrix_lr only, sampling every step."""
    root = tmp_path_factory.mktemp("two-runs")
    runs = []
    for name, lr in (("base", 0.03), ("lower-lr", 0.02)):
        cfg = apply_overrides(tiny_preset(), {"data": {"data_path": str(tiny_data_dir)}, "optim": {"matrix_lr": lr},
                                              "train": {"iterations": 3, "warmup_steps": 0, "sample_every": 2,
                                                        "sample_prompt": "It was"}})
        train(cfg, root / name)
        runs.append(root / name)
    return runs


@pytest.mark.slow
def test_training_logs_greedy_samples(two_runs):
    log = (two_runs[0] / "train.log").read_text()
    samples = [line for line in log.splitlines() if line.startswith("sample step:")]
    assert len(samples) == 1 and samples[0].startswith("sample step:2 'It was")
    assert len(samples[0]) > len("sample step:2 'It was'")


def test_compare_puts_runs_side_by_side_with_their_differing_setting(two_runs):
    result = compare(two_runs)
    assert result["settings"] == {"optim.matrix_lr": [0.03, 0.02]}
    columns = result["columns"]
    assert [c["name"] for c in columns] == ["base", "lower-lr"]
    for run, c in zip(two_runs, columns):
        summary = json.loads((run / "summary.json").read_text())
        assert c["steps"] == 3 and c["val_bpb"] == summary["val_bpb"]
        assert c["post_ema_val_bpb"] == summary["post_ema_val_bpb"]
        assert c["ms_per_step"] == pytest.approx(summary["training_time_ms"] / 3)
    shown = cli("compare", *two_runs)
    assert shown.exit_code == 0 and "optim.matrix_lr" in shown.stdout and "lower-lr" in shown.stdout
    assert json.loads(cli("compare", *two_runs, "--json").stdout) == json.loads(json.dumps(result))


@pytest.mark.slow
def test_plot_writes_a_png_and_an_html_page(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    png = plot_runs(two_runs, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = cli("plot", *two_runs, "--out", tmp_path / "curves.html")
    assert page.exit_code == 0, page.output
    html = (tmp_path / "curves.html").read_text()
    assert "<svg" in html and "lower-lr (matrix_lr=0.02)" in html and "base (matrix_lr=0.03)" in html


def test_plot_without_matplotlib_names_the_extra(two_runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as when not installed
    with pytest.raises(ConfigError, match=r"windowgpt\[plot\]"):
        plot_runs(two_runs, tmp_path / "curves.png")


def test_tensorboard_logger_receives_the_metrics_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, enabled=True, echo=lambda line: None, sink=open_sink("tensorboard", tmp_path, tiny_preset()))
    log.metrics(step=1, train_loss=5.5, train_time_ms=10.0)
    log.metrics(step=2, val_loss=5.0, val_bpb=2.5)
    log.sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in written:
        for name, value in record.items():
            if name != "step":
                [scalar] = [e for e in events.Scalars(name) if e.step == record["step"]]
                assert scalar.value == pytest.approx(value)


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_missing_logger_extra_is_one_line_naming_it(tmp_path, monkeypatch, logger):
    monkeypatch.setitem(sys.modules, logger, None)
    with pytest.raises(ConfigError, match=rf"windowgpt\[{logger}\]"):
        open_sink(logger, tmp_path, tiny_preset())
