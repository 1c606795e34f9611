"""Collect bench/ttt_methods.sh's reports into one JSON:
{"gpu": NAME, "models": {MODEL: {"sliding": bpb, "chunks": bpb, "lora": bpb, "lora_VARIANT": bpb, ...,
 "seconds": {...}, "settings": {...}}}}, merged into --out where it exists (one model per run). The GPU is
the one the reports name (`eval_cap.hardware`), so the collector may run elsewhere; a report left empty by a
stopped run is skipped."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def reports(logs: Path, out: Path) -> dict[str, dict]:
    """The scoring reports in logs by name, skipping the output and any report a stopped run left unfinished."""
    found = {}
    for path in sorted(logs.glob("*.json")):
        if path == out:
            continue
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"skipped {path.name}: not a finished report", file=sys.stderr)
            continue
        if "val_bpb" in record:
            found[path.stem] = record
    return found


def gpu_name(records: dict[str, dict]) -> str:
    """The GPU the reports ran on ("1 x NVIDIA H200" -> "NVIDIA H200"), else this machine's."""
    for record in records.values():
        hardware = record.get("eval_cap", {}).get("hardware", "")
        if " x " in hardware:
            return hardware.split(" x ", 1)[1]
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("logs", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = reports(args.logs, args.out)
    entry: dict = {"seconds": {}, "settings": {}}
    for name, record in records.items():
        entry[name] = record["val_bpb"]
        entry["seconds"][name] = record["seconds"]
        if record.get("mode") == "ttt_lora":
            entry["settings"][name] = {k: v for k, v in record["ttt"].items() if k.startswith("ttt_lora")}
            entry.setdefault("per_phase", {})[name] = [p["val_bpb"] for p in record["per_phase"]]
        if "eval_cap" in record:
            entry.setdefault("eval_cap_seconds", record["eval_cap"]["cap_seconds"])
    if "sliding" in entry:
        entry["gain_over_sliding"] = {k: round(entry["sliding"] - v, 6) for k, v in entry.items()
                                      if k.startswith(("chunks", "lora")) and isinstance(v, float)}
    result = json.loads(args.out.read_text()) if args.out.exists() else {"models": {}}
    result["gpu"] = gpu_name(records)
    result["models"][args.model] = entry
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(entry, indent=1))


if __name__ == "__main__":
    main()
