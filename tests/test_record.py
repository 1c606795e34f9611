"""A record run on the CPU: GPTQ calibrated inside the training budget, quantize using those
Hessians, the code a record run imports (run from its packed archive, as `make record` runs
it), and the report that checks the rules."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from windowgpt_cli.record import codesize
from windowgpt_cli.storage.files import tensors_sha256
from windowgpt_cli.challenge import AFTER_TRAINING, INSIDE_TRAINING
from windowgpt_cli.artifacts.checkpoint import HESSIANS_FILENAME
from windowgpt_cli.quant.calibration import load_hessians
from windowgpt_cli.artifacts.checkpoint import load_checkpoint
from windowgpt_cli.cli.app import app
from windowgpt_cli.errors import ArtifactError, ConfigError
from windowgpt_cli.record.archive import pack
from windowgpt_cli.record.codesize import MAIN_SOURCE
from windowgpt_cli.record.rules import FAIL, NOT_APPLICABLE, PASS, Rules, write_report
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.quant.quantize import quantize

REPO = Path(__file__).resolve().parents[1]
CAP_S, RESERVE_S = 20.0, 18.0  # two seconds of training, then calibration with room to spare
WIDE = {"COLUMNS": "200"}
PACKED_RULE = "the code counted is the packed code.pyz"

# The stages of `make record` in one fresh process, laid out as make lays them out, imported
# from the packed archive alone; prints the package modules it imported and where from.
RECORD_FLOW = """
import json, sys
from pathlib import Path
import torch
from windowgpt_cli.config import apply_overrides, tiny_preset
from windowgpt_cli.train.run import train
from windowgpt_cli.artifacts.export import export
from windowgpt_cli.quant.quantize import quantize
from windowgpt_cli.eval.evaluate import evaluate_artifact, ttt_evaluate_artifact

torch.set_num_threads(1)
data, out, cap, reserve = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
cfg = apply_overrides(tiny_preset(), {
    "data": {"data_path": str(data)},
    "train": {"iterations": 10000, "max_wallclock_seconds": cap, "train_log_every": 1},
    "quant": {"use_gptq": True, "gptq_reserve_seconds": reserve}})
train(cfg, out / "train")
export(out / "train", out / "export")
quantize(out / "export", out / "model.ptz", device="cpu")
(out / "eval.json").write_text(json.dumps(evaluate_artifact(out / "model.ptz", data, device="cpu").record))
(out / "eval-ttt.json").write_text(json.dumps(ttt_evaluate_artifact(out / "model.ptz", data, device="cpu").record))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "windowgpt_cli")))
print(sys.modules["windowgpt_cli"].__file__)
"""


@pytest.fixture(scope="module")
def record_flow(tiny_data_dir: Path, tmp_path_factory) -> tuple[Path, list[str]]:
    """(OUT of a tiny record run, the package modules that run imported)."""
    out = tmp_path_factory.mktemp("record") / "out"
    pack(out / "code.pyz")
    done = subprocess.run([sys.executable, "-c", RECORD_FLOW, str(tiny_data_dir), str(out), str(CAP_S),
                           str(RESERVE_S)], cwd=out, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(out / "code.pyz"), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    *_, modules, package_file = done.stdout.strip().splitlines()
    assert package_file == str(out / "code.pyz" / "windowgpt_cli" / "__init__.py")
    return out, json.loads(modules)


def summary_of(out: Path) -> dict:
    return json.loads((out / "train" / "summary.json").read_text())


@pytest.mark.slow
def test_training_stops_early_by_the_reserve_and_calibrates_inside_its_budget(record_flow):
    out, _ = record_flow
    log = (out / "train" / "train.log").read_text()
    effective_ms = 1000 * (CAP_S - RESERVE_S)
    assert f"gptq:reserving {1000 * RESERVE_S:.0f}ms from training budget, effective={effective_ms:.0f}ms" in log
    summary = summary_of(out)
    assert summary["step"] < 10000 and "stopping_early: wallclock_cap" in log
    assert effective_ms <= summary["training_time_ms"] < 1000 * CAP_S
    calibration = summary["calibration"]
    assert calibration["batches"] == 4 and calibration["tokens"] == 4 * 32 * 128  # the tiny preset's batches
    assert calibration["layers"] == 4 * 6 and calibration["reserve_seconds"] == RESERVE_S
    assert not calibration["overran_reserve"] and "overran" not in log
    total = summary["training_time_ms"] + 1000 * calibration["seconds"]
    assert summary["training_plus_calibration_ms"] == pytest.approx(total, abs=0.2)
    assert summary["training_plus_calibration_ms"] <= 1000 * CAP_S
    assert summary["world_size"] == 1 and summary["devices"] == ["cpu"]
    line = re.search(r"gptq:calibrated (\d+) layers in (\d+\.\d)s \((\d+) batches, (\d+) tokens\)", log)
    assert line and (line[1], line[3], line[4]) == ("24", "4", str(calibration["tokens"]))
    assert float(line[2]) == pytest.approx(calibration["seconds"], abs=0.051)  # the log shows one decimal
    assert log.index("ema:applying EMA weights") < log.index("gptq:calibrating")

    stored = load_hessians(out / "train" / HESSIANS_FILENAME)
    assert stored.step == summary["step"] and stored.batches == 4 and stored.tokens == calibration["tokens"]
    assert stored.weights_sha256 == tensors_sha256(load_checkpoint(out / "train").weights("ema"))
    assert sum(len(names) for names in stored.hessians) == 24
    # The export of the EMA weights carries them.
    assert (out / "export" / HESSIANS_FILENAME).read_bytes() == (out / "train" / HESSIANS_FILENAME).read_bytes()
    assert json.loads((out / "export" / "export.json").read_text())["hessians"] == HESSIANS_FILENAME


@pytest.mark.slow
def test_quantize_uses_the_runs_hessians_and_equals_calibrating_the_same_batches_after(
        record_flow, tiny_data_dir: Path, tmp_path: Path, quant_single_thread):
    out, _ = record_flow
    report = json.loads((out / "model.ptz.json").read_text())
    assert report["calibration"] == INSIDE_TRAINING and report["calib_batches"] == 4
    assert report["calibration_info"]["step"] == summary_of(out)["step"]
    after = quantize(out / "export", tmp_path / "after.ptz", gptq=True, data_dir=tiny_data_dir, recalibrate=True,
                     device="cpu")
    assert after["calibration"] == AFTER_TRAINING
    assert (tmp_path / "after.ptz").read_bytes() == (out / "model.ptz").read_bytes()

    result = CliRunner().invoke(app, ["quantize", str(out / "export"), "--out", str(tmp_path / "cli.ptz"), "--gptq",
                                      "--device", "cpu"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "calibration: inside training (4 batches" in result.output
    with pytest.raises(ConfigError, match="--calib-batches 2 needs --recalibrate"):
        quantize(out / "export", tmp_path / "x.ptz", gptq=True, calib_batches=2, device="cpu")
    # Hessians collected without the output layer's cannot serve GPTQ on the embedding: one
    # line, nothing written; calibrating afresh collects it
    with pytest.raises(ConfigError, match="lack .* --recalibrate --data DATA"):
        quantize(out / "export", tmp_path / "y.ptz", gptq=True, device="cpu", settings={"quant_gptq_embed": True})
    assert not (tmp_path / "y.ptz").exists()
    fresh = quantize(out / "export", tmp_path / "y.ptz", gptq=True, data_dir=tiny_data_dir, recalibrate=True,
                     device="cpu", settings={"quant_gptq_embed": True})
    assert fresh["schemes"].get("int8_gptq") == 1  # the embedding


@pytest.mark.slow
def test_other_weights_never_take_the_ema_hessians(record_flow, tmp_path: Path, quant_single_thread):
    out, _ = record_flow
    last = tmp_path / "last"
    shutil.copytree(out / "export", last)  # an export directory that holds the EMA Hessians ...
    info = export(out / "train", last, weights="last")  # ... exported again with the last weights
    assert info["hessians"] is None and not (last / HESSIANS_FILENAME).exists()
    # Without Hessians, quantize calibrates on the run's data after training, and says so.
    assert quantize(last, tmp_path / "last.ptz", gptq=True, device="cpu")["calibration"] == AFTER_TRAINING
    shutil.copyfile(out / "train" / HESSIANS_FILENAME, last / HESSIANS_FILENAME)
    with pytest.raises(ArtifactError, match="collected under other weights"):
        quantize(last, tmp_path / "last.ptz", gptq=True, device="cpu")


@pytest.mark.slow
def test_code_bytes_count_every_module_the_record_run_imports(record_flow):
    out, imported = record_flow
    closure = codesize.import_closure()
    assert set(imported) <= set(closure), sorted(set(imported) - set(closure))
    assert "windowgpt_cli.train.run" in imported and "windowgpt_cli.quant.calibration" in imported
    assert not {"windowgpt_cli.cli.app", "windowgpt_cli.cli.prepare", "windowgpt_cli.record.rules"} & set(closure)
    whole_package = sum(p.stat().st_size for p in codesize.PACKAGE_DIR.rglob("*.py"))
    report = json.loads((out / "model.ptz.json").read_text())
    # Counted: the archive the stages ran from; beside it, the same files' source.
    assert report["code_archive"] == str(out / "code.pyz") and report["code_counted"].startswith("zipapp (deflate)")
    assert report["code_bytes"] == (out / "code.pyz").stat().st_size < codesize.code_bytes() / 2
    assert report["code_source_bytes"] == codesize.code_bytes() + len(MAIN_SOURCE) < whole_package
    assert report["code_modules"] == ["__main__.py", *codesize.record_modules()]


def copy_of(out: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return copy


def statuses(record: dict) -> dict[str, str]:
    return {c["rule"]: c["status"] for c in record["checks"]}


def test_report_of_a_tiny_run_passes_and_marks_the_eight_gpu_limits(record_flow, tmp_path: Path):
    out = copy_of(record_flow[0], tmp_path)
    record = write_report(out)
    status = statuses(record)
    assert record["passed"] and set(status.values()) == {PASS, NOT_APPLICABLE}
    na = {c["rule"]: c["note"] for c in record["checks"] if c["status"] == NOT_APPLICABLE}
    assert na["training + GPTQ calibration"] == na["evaluation (sliding + TTT)"] == "not applicable on 1 GPU"
    assert status["GPTQ calibrated inside the training budget"] == status["TTT trains only on tokens already scored"] \
        == status["artifact (code + compressed model)"] == status[PACKED_RULE] == PASS
    summary, quant = summary_of(out), json.loads((out / "model.ptz.json").read_text())
    budget_s = summary["training_plus_calibration_ms"] / 1000
    assert record["training_seconds"]["total"] == pytest.approx(budget_s, abs=1e-3)
    assert record["bytes"]["total"] == quant["model_bytes"] + quant["code_bytes"]
    assert record["val_bpb"]["ttt"] == json.loads((out / "eval-ttt.json").read_text())["val_bpb"]
    assert record["evaluation_seconds"]["measured"].startswith("scoring time")  # no make, no wall times
    assert json.loads((out / "record.json").read_text()) == record
    readme = (out / "README.md").read_text()
    assert "keeps every rule checked" in readme and f"{record['bytes']['total']:,}" in readme
    assert f"| code: {quant['code_counted']} | {quant['code_bytes']:,} bytes (its source uncompressed: " \
           f"{quant['code_source_bytes']:,} bytes) |" in readme
    assert write_report(out, Rules(gpus=1))["passed"]  # the time limits, applied to this one process


def test_report_flags_broken_rules_and_the_command_exits_1(record_flow, tmp_path: Path):
    out = copy_of(record_flow[0], tmp_path)
    summary = summary_of(out)
    # A budget that fits the training steps but not the calibration after them.
    tight = Rules(gpus=1, train_seconds=summary["training_time_ms"] / 1000)
    assert statuses(write_report(out, tight))["training + GPTQ calibration"] == FAIL
    total = write_report(out)["bytes"]["total"]
    assert statuses(write_report(out, Rules(artifact_bytes=total - 1)))["artifact (code + compressed model)"] == FAIL

    result = CliRunner().invoke(app, ["report", str(out), "--artifact-budget", str(total - 1)], env=WIDE)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.count("error:") == 1 and "artifact (code + compressed model)" in result.output
    assert "BREAKS A RULE" in (out / "README.md").read_text()
    (out / "code.pyz").write_bytes(b"other code")  # not the code quantize counted
    assert statuses(write_report(out))[PACKED_RULE] == FAIL

    # A TTT record that trained before scoring, and an artifact calibrated after training.
    ttt = json.loads((out / "eval-ttt.json").read_text())
    (out / "eval-ttt.json").write_text(json.dumps({**ttt, "ttt_order": "train-first"}))
    quant = json.loads((out / "model.ptz.json").read_text())
    (out / "model.ptz.json").write_text(json.dumps({**quant, "calibration": AFTER_TRAINING}))
    record = write_report(out)
    status = statuses(record)
    assert status["TTT trains only on tokens already scored"] == status["GPTQ calibrated inside the training budget"] \
        == FAIL
    assert record["training_seconds"]["total"] > summary["training_plus_calibration_ms"] / 1000  # it counts too


@pytest.mark.slow
def test_a_reserve_too_small_for_calibration_is_logged_and_fails_the_report(record_flow, tiny_data_dir, tmp_path,
                                                                          quant_single_thread):
    from windowgpt_cli.config import apply_overrides, tiny_preset
    from windowgpt_cli.train.run import train

    cap = 3.0
    cfg = apply_overrides(tiny_preset(), {"data": {"data_path": str(tiny_data_dir)},
                                          "train": {"iterations": 10000, "max_wallclock_seconds": cap},
                                          "quant": {"use_gptq": True, "gptq_reserve_seconds": 0.001}})
    train(cfg, tmp_path / "run")
    log = (tmp_path / "run" / "train.log").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["calibration"]["overran_reserve"]
    assert "gptq:calibration overran its reserve of 1ms" in log and summary["training_plus_calibration_ms"] > 1000 * cap
    out = copy_of(record_flow[0], tmp_path)
    shutil.copyfile(tmp_path / "run" / "summary.json", out / "train" / "summary.json")
    check = next(c for c in write_report(out, Rules(gpus=1, train_seconds=cap))["checks"]
                 if c["rule"] == "training + GPTQ calibration")
    assert check["status"] == FAIL and check["value"] == f"{summary['training_plus_calibration_ms'] / 1000:.1f} s"


def test_the_makefile_trains_the_record_model_the_benchmarks_measure():
    """RECORD_MODEL_FLAGS (the Makefile's record run) and challenge.RECORD_WINDOWS (the
    benchmarks' record model) name the same windows."""
    from windowgpt_cli.challenge import RECORD_WINDOWS

    line = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("RECORD_MODEL_FLAGS"))
    flags = dict(re.findall(r"--([\w-]+) (\S+)", line))
    assert {name.replace("-", "_"): value for name, value in flags.items()} == {
        name: ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        for name, value in RECORD_WINDOWS.items()}
