"""Collect bench/frontier.sh's runs into one JSON and print its table:
{"gpu": NAME, "budget_s": 240, "runs": {NAME: {"steps", "ms_per_step", "val_bpb", "ptz_bytes", ...}}}.
Runs already in --out stay unless measured again (a preset's runs may span several calls:
the JSON files of earlier calls merge as they were written); each run records the commit and
day it was measured on."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

BUDGET_BYTES = 16_000_000


def run_entry(folder: Path, code_bytes: int) -> dict:
    """One run's figures from its logs: summary.json and config.json (train), quantize.json
    and eval.json (and eval_unquantized.json, eval_seqN.json where scored); code_bytes: the
    packed code's, counted with the model's."""
    train = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    quantize = json.loads((folder / "quantize.json").read_text())
    scored = json.loads((folder / "eval.json").read_text())
    calibration = train.get("calibration") or {}
    unquantized = folder / "eval_unquantized.json"
    extra = {}
    if unquantized.exists():
        extra["unquantized_val_bpb"] = json.loads(unquantized.read_text())["val_bpb"]
        extra["quantization_loss"] = round(scored["val_bpb"] - extra["unquantized_val_bpb"], 6)
    by_seq_len = {int(p.stem.removeprefix("eval_seq")): json.loads(p.read_text())["val_bpb"]
                  for p in folder.glob("eval_seq*.json")}  # the same .ptz, windows of other lengths
    if by_seq_len:
        if "seq_len" in scored:  # beside the run's own score, at its own length
            by_seq_len[scored["seq_len"]] = scored["val_bpb"]
        extra["val_bpb_by_eval_seq_len"] = {str(n): by_seq_len[n] for n in sorted(by_seq_len)}
    fit = quantize.get("fit") or {}
    if fit.get("zeroed_codes"):  # what fitting into the budget gave up (quant_fit_budget)
        extra["fit"] = {key: fit[key] for key in ("zeroed_codes", "zeroed_fraction", "bytes_before")}
    return extra | {
        "steps": train["step"], "ms_per_step": train["ms_per_step"],
        "training_plus_calibration_s": round(train["training_plus_calibration_ms"] / 1000.0, 1),
        "calibration_s": calibration.get("seconds"),
        "graphs_compiled_in_training": train.get("graphs_compiled_in_training"),
        **({"kernels": train["kernels"]} if train.get("kernels") else {}),  # what auto chose, where recorded
        "pre_quant_val_bpb": train["post_ema_val_bpb"], "val_bpb": scored["val_bpb"],
        "ptz_bytes": quantize["model_bytes"], "code_bytes": code_bytes,
        "total_bytes": quantize["model_bytes"] + code_bytes,
        "within_16mb": quantize["model_bytes"] + code_bytes <= BUDGET_BYTES, "compressor": quantize["compressor"],
        "vocab_size": config["model"]["vocab_size"],
        "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
    }


def _commit() -> str | None:
    if os.environ.get("COMMIT"):  # a copy of the tree without its repository names it so
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("logs", type=Path, nargs="+",
                        help="bench/frontier.sh's LOG_DIRs, or the frontier_h200.json files its calls wrote "
                             "(their runs taken as they are)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", help="collect only this run")
    parser.add_argument("--budget-s", type=float, default=240)
    args = parser.parse_args()
    import torch

    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = result.get("runs", {})
    for logs in args.logs:
        if logs.is_file():
            written = json.loads(logs.read_text())
            runs |= {name: r for name, r in written["runs"].items() if args.only in (None, name)}
            result.setdefault("gpu", written.get("gpu"))
            continue
        code_bytes = int((logs / "packed_code_bytes").read_text())
        for folder in sorted(p for p in logs.iterdir() if (p / "eval.json").exists()):
            if args.only in (None, folder.name):
                runs[folder.name] = run_entry(folder, code_bytes)
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    result["budget_s"] = args.budget_s
    result["runs"] = runs
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    base = runs.get("default", {}).get("val_bpb")
    print("| run | steps | ms/step | pre-quant bpb | val_bpb | vs default | bytes (with code) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in runs.items():
        delta = f"{r['val_bpb'] - base:+.4f}" if base is not None else "n/a"
        pre_quant = f"{r['pre_quant_val_bpb']:.4f}" if r.get("pre_quant_val_bpb") is not None else ""
        print(f"| {name} | {r['steps']} | {r['ms_per_step']:.1f} | {pre_quant} | "
              f"{r['val_bpb']:.5f} | {delta} | {r['total_bytes']:,} |")


if __name__ == "__main__":
    main()
