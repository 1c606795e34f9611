"""bench/pipeline_report.py: the JSON and table it assembles from bench/pipeline.sh's logs; and the
model bench/pipeline.sh trains."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from windowgpt_cli.config import tiny_preset
from windowgpt_cli.train.run import summary
from windowgpt_cli.train.trainer import TrainResult

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report_module():
    spec = importlib.util.spec_from_file_location("pipeline_report", REPO / "bench" / "pipeline_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def train_summary(training_ms: float, calibration_s: float | None) -> dict:
    """summary.json as `train` writes it."""
    calibration = {"seconds": calibration_s, "batches": 4, "tokens": 4096} if calibration_s is not None else None
    result = TrainResult(step=12, training_time_ms=training_ms, finished=True, calibration=calibration,
                         devices=["NVIDIA H200"])
    return summary(result, tiny_preset())


def quant_report(load: float, total: float, model_bytes: int) -> dict:
    return {"model_bytes": model_bytes, "timings_s": {"load": load, "hessians": 0.5, "quantize": 3.0, "gptq": 2.5,
                                                      "compress": 1.0, "total": total}}


def timed(folder: Path, command: str, wall: float, rc: str = "0", cache: tuple[int, int] = (0, 9)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{command}.rc").write_text(f"{rc}\n")
    (folder / f"{command}.wall_s").write_text(f"{wall:.3f}\n")
    (folder / f"{command}.cache_files").write_text(f"{cache[0]} {cache[1]}\n")


def write_pass(logs: Path, name: str, scale: float, cache_before: int) -> None:
    """Every command's logs for one pass, as pipeline.sh leaves them; times scale with `scale`."""
    folder = logs / name
    cache = (cache_before, cache_before + 5)
    for command, wall in (("prepare", 20), ("train", 100), ("export", 8), ("quantize", 30), ("eval", 40),
                          ("eval_ttt", 60), ("smoke_gpu", 270)):
        timed(folder, command, wall * scale, cache=cache)
    write_json(folder / "prepare.json", {"splits": {}, "seconds": 12.5 * scale})
    write_json(folder / "train.summary.json", train_summary(16000.0 * scale, 3.0))
    write_json(folder / "export.json", {"step": 12})
    write_json(folder / "quantize.report.json", quant_report(2.0, 12.0 * scale, 9_000_000))
    write_json(folder / "eval.json", {"mode": "sliding", "val_bpb": 1.7, "seconds": 19.5 * scale})
    write_json(folder / "eval_ttt.json", {"mode": "ttt", "val_bpb": 1.69, "seconds": 44.0 * scale})
    smoke = folder / "smoke_gpu"
    write_json(smoke / "summary.json", train_summary(20000.0, None))
    write_json(smoke / "model.ptz.json", quant_report(1.0, 5.0, 8_000_000))
    write_json(smoke / "eval.json", {"val_bpb": 1.75, "seconds": 19.0})
    write_json(smoke / "eval-ttt.json", {"val_bpb": 1.74, "seconds": 30.0})


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    write_pass(logs, "cold", 1.0, cache_before=0)
    write_pass(logs, "warm", 0.5, cache_before=40)
    (logs / "gpu.txt").write_text("NVIDIA H200\n")
    return logs


def test_each_command_gets_its_wall_time_and_the_work_it_reports(report_module, logs):
    report = report_module.build_report([logs])
    assert report["gpu"] == "NVIDIA H200"
    cold, warm = report["cold"], report["warm"]
    assert list(cold) == list(report_module.COMMANDS)
    assert cold["prepare"] == {"wall_s": 20.0, "work_s": 12.5}
    assert cold["train"] == {"wall_s": 100.0, "work_s": 19.0}  # 16 s of steps + 3 s of calibration
    assert cold["export"] == {"wall_s": 8.0, "work_s": None}
    assert cold["quantize"] == {"wall_s": 30.0, "work_s": 10.0}  # total less loading
    assert cold["eval"] == {"wall_s": 40.0, "work_s": 19.5}
    assert cold["eval_ttt"] == {"wall_s": 60.0, "work_s": 44.0}
    assert cold["smoke_gpu"] == {"wall_s": 270.0, "work_s": pytest.approx(20.0 + 4.0 + 19.0 + 30.0)}
    assert warm["train"] == {"wall_s": 50.0, "work_s": 11.0}
    assert warm["quantize"] == {"wall_s": 15.0, "work_s": 4.0}
    assert report["results"]["cold"] == {
        "eval_val_bpb": 1.7, "eval_ttt_val_bpb": 1.69, "ptz_bytes": 9_000_000, "smoke_gpu_eval_val_bpb": 1.75,
        "smoke_gpu_eval_ttt_val_bpb": 1.74, "smoke_gpu_ptz_bytes": 8_000_000}
    assert report["cache_files"]["warm"]["eval"] == {"before": 40, "after": 45}
    assert report_module.cache_warnings(report) == []


def test_failed_skipped_and_unfinished_commands(report_module, logs):
    timed(logs / "cold", "eval_ttt", 3.0, rc="1")
    (logs / "warm" / "smoke_gpu.rc").write_text("skipped\n")
    (logs / "cold" / "smoke_gpu" / "eval-ttt.json").unlink()  # make stopped before its last stage
    report = report_module.build_report([logs])
    assert report["cold"]["eval_ttt"] == {"wall_s": None, "work_s": None, "exit_status": "1"}
    assert report["warm"]["smoke_gpu"] == {"wall_s": None, "work_s": None, "exit_status": "skipped"}
    assert report["cold"]["smoke_gpu"] == {"wall_s": 270.0, "work_s": None}
    table = report_module.markdown_table(report)
    assert "| eval_ttt | exit 1 | exit 1 | 30.0 s | 22.0 s |" in table
    assert "| smoke_gpu | 270.0 s | n/a | exit skipped | exit skipped |" in table


def test_later_logs_override_earlier_ones_command_by_command(report_module, logs, tmp_path: Path):
    later = tmp_path / "later"
    for name in ("cold", "warm"):  # a second run of pipeline.sh with COMMANDS=smoke_gpu
        timed(later / name, "smoke_gpu", 200.0)
        write_json(later / name / "smoke_gpu" / "eval.json", {"val_bpb": 1.5, "seconds": 1.0})
    report = report_module.build_report([logs, later])
    assert report["gpu"] == "NVIDIA H200"  # the later folder names no GPU: the earlier one's stands
    assert report["cold"]["smoke_gpu"] == {"wall_s": 200.0, "work_s": None}  # its other stages are missing
    assert report["cold"]["train"] == {"wall_s": 100.0, "work_s": 19.0}
    assert report["results"]["cold"]["smoke_gpu_eval_val_bpb"] == 1.5
    assert report["results"]["cold"]["eval_val_bpb"] == 1.7


def test_caches_that_were_not_what_the_pass_says_are_flagged(report_module, logs):
    timed(logs / "cold", "train", 100.0, cache=(7, 9))
    timed(logs / "warm", "eval", 20.0, cache=(0, 3))
    timed(logs / "warm", "prepare", 10.0, cache=(0, 0))  # prepare compiles nothing: never flagged
    warnings = report_module.cache_warnings(report_module.build_report([logs]))
    assert len(warnings) == 2
    assert warnings[0].startswith("cold train started with 7 files")
    assert warnings[1].startswith("warm eval started with empty caches")


def test_main_writes_every_out_and_prints_the_table(report_module, logs, tmp_path: Path, capsys):
    outs = [tmp_path / "a" / "pipeline.json", tmp_path / "results" / "pipeline_h200.json"]
    assert report_module.main([str(logs), "--out", str(outs[0]), "--out", str(outs[1])]) == 0
    written = [json.loads(p.read_text()) for p in outs]
    assert written[0] == written[1] == report_module.build_report([logs])
    printed = capsys.readouterr().out
    assert "| command | cold wall | cold work | warm wall | warm work |" in printed
    assert "| train | 100.0 s | 19.0 s | 50.0 s | 11.0 s |" in printed
    assert "| export | 8.0 s | n/a | 4.0 s | n/a |" in printed


def test_main_refuses_a_missing_log_folder(report_module, tmp_path: Path, capsys):
    assert report_module.main([str(tmp_path / "nowhere")]) == 1
    assert "no such log folder" in capsys.readouterr().err


def test_a_command_no_log_folder_ran_is_listed_as_not_run(report_module, logs):
    for name in ("cold", "warm"):
        for suffix in ("wall_s", "rc", "cache_files"):
            (logs / name / f"smoke_gpu.{suffix}").unlink(missing_ok=True)
    report = report_module.build_report([logs])
    assert report["warm"]["smoke_gpu"] == {"wall_s": None, "work_s": None, "exit_status": "not run"}
    assert list(report["cold"]) == list(report_module.COMMANDS)
    assert "| smoke_gpu | not run | not run | not run | not run |" in report_module.markdown_table(report)


# --- bench/pipeline.sh's model choice ----------------------------------------------------

WINDOW_FLAGS = "--window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10"


def pipeline_train_command(tmp_path: Path, model: str) -> subprocess.CompletedProcess:
    """bench/pipeline.sh's train command for MODEL, with `echo` standing in for python."""
    env = dict(os.environ, MODEL=model, PYTHON="echo", COMMANDS="train", PASSES="cold", DEADLINE_S="0",
               RESULT=str(tmp_path / "result.json"))
    return subprocess.run(["bash", str(REPO / "bench" / "pipeline.sh"), str(tmp_path / "shared"), str(tmp_path / "w"),
                           str(tmp_path / "logs")], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model,windows", [("record", True), ("full", False)])
def test_the_pipeline_trains_the_model_asked_for(tmp_path: Path, model: str, windows: bool):
    pipeline_train_command(tmp_path, model)
    command = (tmp_path / "logs" / "cold" / "train.out").read_text()
    assert command.startswith("-m windowgpt_cli train ") and "--use-gptq" in command
    assert (WINDOW_FLAGS in command) == windows
    smoke = subprocess.run(["make", "-n", "-C", str(REPO), "smoke-gpu", "DATA=data",
                            *([] if windows else ["RECORD_MODEL_FLAGS="])], capture_output=True, text=True)
    assert smoke.returncode == 0 and "train --data data" in smoke.stdout
    assert (WINDOW_FLAGS in smoke.stdout) == windows


def test_the_pipeline_refuses_an_unknown_model(tmp_path: Path):
    done = pipeline_train_command(tmp_path, "huge")
    assert done.returncode == 2 and "MODEL: huge is neither record nor full" in done.stdout


# --- bench/ttt_results.py --------------------------------------------------------------------


def test_ttt_results_names_the_reports_gpu_and_skips_a_report_a_stopped_run_left_empty(tmp_path):
    """The collector may run off the GPU: the GPU is the one the reports name, and an empty
    report (its run stopped at the call's limit) is skipped, not a crash."""
    logs = tmp_path / "logs"
    cap = {"seconds": 20.0, "cap_seconds": 4800.0, "hardware": "1 x NVIDIA H200", "within": True}
    write_json(logs / "sliding.json", {"val_bpb": 1.5, "seconds": 18.0, "eval_cap": cap})
    write_json(logs / "lora.json", {"val_bpb": 1.49, "seconds": 200.0, "mode": "ttt_lora", "eval_cap": cap,
                                    "ttt": {"ttt_lora_rank": 80, "ttt_lr": 0.002},
                                    "per_phase": [{"val_bpb": 1.45}, {"val_bpb": 1.52}]})
    (logs / "lora_chunk32.json").write_text("")
    out = tmp_path / "ttt.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "ttt_results.py"), str(logs), "--model", "m",
                           "--out", str(out)], capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())
    entry = result["models"]["m"]
    assert result["gpu"] == "NVIDIA H200" and "lora_chunk32" not in entry
    assert entry["gain_over_sliding"] == {"lora": 0.01} and entry["settings"]["lora"] == {"ttt_lora_rank": 80}
    assert entry["per_phase"]["lora"] == [1.45, 1.52] and "skipped lora_chunk32.json" in done.stderr
