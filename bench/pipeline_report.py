"""Assemble bench/pipeline.sh's logs into one JSON and a markdown table.

    python3 bench/pipeline_report.py LOG_DIR [LOG_DIR ...] [--out FILE ...]

For each pass (cold, warm) and command, `wall_s` is the whole process's seconds (what
pipeline.sh timed) and `work_s` the work the command reports itself:

- prepare: the `seconds` of `prepare --json`
- train: training time plus GPTQ's calibration (summary.json's training_plus_calibration_ms)
- export: null (export reports no time)
- quantize: its report's `timings_s` total less loading the weights (MODEL.ptz.json)
- eval, eval_ttt: the `seconds` of their `--json` records
- smoke_gpu: the sum of those of its stages (train, quantize, eval, eval-ttt), from the
  files `make smoke-gpu` left in its OUT

`results` holds, per pass, the val_bpb of eval and eval-ttt and the .ptz's bytes (and those
of smoke_gpu's run). Logs given later override earlier ones command by command, so the
logs of separate runs of pipeline.sh (e.g. one with SKIP_SMOKE=1, one with
COMMANDS=smoke_gpu) merge into one report. Pure Python: runs without torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PASSES = ("cold", "warm")
COMMANDS = ("prepare", "train", "export", "quantize", "eval", "eval_ttt", "smoke_gpu")
NOT_RUN = {"wall_s": None, "work_s": None, "exit_status": "not run"}  # a command no log folder ran
SMOKE_DIR = "smoke_gpu"  # LOG_DIR/PASS/smoke_gpu/: the files of `make smoke-gpu`'s OUT


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# --- The work each command reports ----------------------------------------------------------

def train_work(summary: dict[str, Any] | None) -> float | None:
    if summary is None:
        return None
    total_ms = summary.get("training_plus_calibration_ms", summary.get("training_time_ms"))
    return None if total_ms is None else total_ms / 1000.0


def quantize_work(report: dict[str, Any] | None) -> float | None:
    timings = (report or {}).get("timings_s") or {}
    if "total" not in timings:
        return None
    return timings["total"] - timings.get("load", 0.0)


def seconds_field(record: dict[str, Any] | None) -> float | None:
    return (record or {}).get("seconds")


def smoke_work(folder: Path) -> float | None:
    """The work of `make smoke-gpu`'s timed stages; None unless every one reported it."""
    parts = [train_work(read_json(folder / "summary.json")), quantize_work(read_json(folder / "model.ptz.json")),
             seconds_field(read_json(folder / "eval.json")), seconds_field(read_json(folder / "eval-ttt.json"))]
    return None if any(p is None for p in parts) else sum(parts)


def command_work(pass_dir: Path, command: str) -> float | None:
    if command == "prepare":
        return seconds_field(read_json(pass_dir / "prepare.json"))
    if command == "train":
        return train_work(read_json(pass_dir / "train.summary.json"))
    if command == "export":
        return None
    if command == "quantize":
        return quantize_work(read_json(pass_dir / "quantize.report.json"))
    if command in ("eval", "eval_ttt"):
        return seconds_field(read_json(pass_dir / f"{command}.json"))
    if command == "smoke_gpu":
        return smoke_work(pass_dir / SMOKE_DIR)
    raise ValueError(f"unknown command {command!r}")


# --- One log folder -------------------------------------------------------------------------

def read_command(pass_dir: Path, command: str) -> dict[str, Any] | None:
    """The command's entry, or None where this log folder did not run it."""
    rc = read_text(pass_dir / f"{command}.rc")
    if rc is None:
        return None
    entry: dict[str, Any] = {"wall_s": None, "work_s": None}
    if rc != "0":
        entry["exit_status"] = rc  # a number, or "skipped" past pipeline.sh's deadline
        return entry
    wall = read_text(pass_dir / f"{command}.wall_s")
    entry["wall_s"] = round(float(wall), 3) if wall else None
    work = command_work(pass_dir, command)
    entry["work_s"] = None if work is None else round(work, 3)
    return entry


def read_cache_files(pass_dir: Path, command: str) -> dict[str, int] | None:
    counts = (read_text(pass_dir / f"{command}.cache_files") or "").split()
    return {"before": int(counts[0]), "after": int(counts[1])} if len(counts) == 2 else None


def read_results(pass_dir: Path) -> dict[str, Any]:
    quant, smoke = read_json(pass_dir / "quantize.report.json"), pass_dir / SMOKE_DIR
    smoke_quant = read_json(smoke / "model.ptz.json")
    found = {
        "eval_val_bpb": (read_json(pass_dir / "eval.json") or {}).get("val_bpb"),
        "eval_ttt_val_bpb": (read_json(pass_dir / "eval_ttt.json") or {}).get("val_bpb"),
        "ptz_bytes": (quant or {}).get("model_bytes"),
        "smoke_gpu_eval_val_bpb": (read_json(smoke / "eval.json") or {}).get("val_bpb"),
        "smoke_gpu_eval_ttt_val_bpb": (read_json(smoke / "eval-ttt.json") or {}).get("val_bpb"),
        "smoke_gpu_ptz_bytes": (smoke_quant or {}).get("model_bytes"),
    }
    return {key: value for key, value in found.items() if value is not None}


# --- The report -----------------------------------------------------------------------------

def build_report(log_dirs: list[Path]) -> dict[str, Any]:
    """{"gpu", "cold": {command: {wall_s, work_s}}, "warm": {...}, "results", "cache_files"};
    later log folders override earlier ones, command by command."""
    report: dict[str, Any] = {"gpu": None, **{p: {} for p in PASSES}, "results": {p: {} for p in PASSES},
                              "cache_files": {p: {} for p in PASSES}}
    for log_dir in log_dirs:
        report["gpu"] = read_text(log_dir / "gpu.txt") or report["gpu"]
        for pass_name in PASSES:
            pass_dir = log_dir / pass_name
            for command in COMMANDS:
                entry = read_command(pass_dir, command)
                if entry is not None:
                    report[pass_name][command] = entry
                    cache = read_cache_files(pass_dir, command)
                    if cache is not None:
                        report["cache_files"][pass_name][command] = cache
            report["results"][pass_name].update(read_results(pass_dir))
    for pass_name in PASSES:  # every command, in the commands' order, whatever order the folders came in
        report[pass_name] = {c: report[pass_name].get(c, dict(NOT_RUN)) for c in COMMANDS}
    return report


def cache_warnings(report: dict[str, Any]) -> list[str]:
    """A cold command that found its caches filled, or a warm one that found them empty."""
    warnings = []
    for command, files in report["cache_files"]["cold"].items():
        if files["before"] > 0:
            warnings.append(f"cold {command} started with {files['before']} files in its caches")
    for command, files in report["cache_files"]["warm"].items():
        if files["before"] == 0 and command != "prepare":
            warnings.append(f"warm {command} started with empty caches: it compiled nothing in the cold pass, "
                            "or that pass ran on another WORK_DIR")
    return warnings


def _seconds(entry: dict[str, Any] | None, key: str) -> str:
    if entry is None:
        return "-"
    if entry.get("exit_status") == NOT_RUN["exit_status"]:
        return "not run"
    if entry.get("exit_status") is not None:
        return f"exit {entry['exit_status']}"
    value = entry[key]
    return "n/a" if value is None else f"{value:.1f} s"


def markdown_table(report: dict[str, Any]) -> str:
    lines = [f"GPU: {report['gpu'] or '?'}", "",
             "| command | cold wall | cold work | warm wall | warm work |", "| --- | --- | --- | --- | --- |"]
    for command in COMMANDS:
        cold, warm = report["cold"].get(command), report["warm"].get(command)
        cells = [_seconds(cold, "wall_s"), _seconds(cold, "work_s"), _seconds(warm, "wall_s"), _seconds(warm, "work_s")]
        lines.append(f"| {command} | " + " | ".join(cells) + " |")
    for pass_name in PASSES:
        results = report["results"][pass_name]
        if results:
            lines.append("")
            lines.append(f"{pass_name}: " + ", ".join(f"{k} {v}" for k, v in results.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dirs", nargs="+", type=Path, help="LOG_DIRs of bench/pipeline.sh, earliest first")
    parser.add_argument("--out", type=Path, action="append", default=[], help="JSON file to write (repeatable)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.log_dirs if not d.is_dir()]
    if missing:
        print(f"error: no such log folder: {', '.join(missing)}", file=sys.stderr)
        return 1
    report = build_report(args.log_dirs)
    text = json.dumps(report, indent=2) + "\n"
    for out in args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = out.with_name(out.name + ".tmp")
        temp.write_text(text)
        temp.replace(out)
        print(f"wrote {out}", file=sys.stderr)
    for warning in cache_warnings(report):
        print(f"warning: {warning}", file=sys.stderr)
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
