"""Collect bench/ttt_methods.sh's reports into one JSON:
{"gpu": NAME, "models": {MODEL: {"sliding": bpb, "chunks": bpb, "lora": bpb, "lora_VARIANT": bpb, ...,
 "seconds": {...}, "settings": {...}}}}, merged into --out where it exists (one model per run)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("logs", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    entry: dict = {"seconds": {}, "settings": {}}
    for path in sorted(args.logs.glob("*.json")):
        if path == args.out:
            continue
        record = json.loads(path.read_text())
        if "val_bpb" not in record:
            continue
        name = path.stem
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
    result["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result["models"][args.model] = entry
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(entry, indent=1))


if __name__ == "__main__":
    main()
