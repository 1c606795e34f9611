#!/usr/bin/env bash
# Throughput of `windowgpt prepare` on all cores, and a token-for-token comparison with the
# reference's make_shards.py on the same documents and tokenizer.
#
# usage, from the repository root:
#   PYTHONPATH=$PWD bench/prepare_throughput.sh DATA_SRC TOKENIZER OUT_DIR MAKE_SHARDS_PY
# DATA_SRC holds train_*.jsonl.xz and val.jsonl.xz; OUT_DIR/windowgpt and OUT_DIR/reference
# are replaced. Prints a few lines ending in MATCH or MISMATCH (exit code 1 on MISMATCH).
set -euo pipefail

if [ $# -ne 4 ]; then
    echo "usage: $0 DATA_SRC TOKENIZER OUT_DIR MAKE_SHARDS_PY" >&2
    exit 2
fi
src=$1 tokenizer=$2 out=$3 make_shards=$4
mkdir -p "$out"
rm -rf "$out/windowgpt" "$out/reference"

now() { python3 -c 'import time; print(time.time())'; }

start=$(now)
if ! python3 -m windowgpt_cli prepare "$src"/train_*.jsonl.xz --val "$src/val.jsonl.xz" \
        --tokenizer "$tokenizer" --out "$out/windowgpt" --json > "$out/windowgpt.json" 2> "$out/windowgpt.err"; then
    tail -n 5 "$out/windowgpt.err"
    exit 1
fi
windowgpt_s=$(python3 -c "print($(now) - $start)")

start=$(now)
if ! python3 "$make_shards" "$src" "$out/reference" "$tokenizer" > "$out/reference.log" 2>&1; then
    tail -n 5 "$out/reference.log"
    exit 1
fi
reference_s=$(python3 -c "print($(now) - $start)")

python3 - "$out" "$windowgpt_s" "$reference_s" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np

out, windowgpt_s, reference_s = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
manifest = json.loads((out / "windowgpt.json").read_text())
text_mb = sum(s["text_bytes"] for s in manifest["splits"].values()) / 1e6


def stream(data_dir: Path, split: str) -> np.ndarray:
    files = sorted(data_dir.glob(f"fineweb_{split}_*.bin"))
    return np.concatenate([np.fromfile(f, dtype="<u2", offset=1024) for f in files])


print(f"windowgpt prepare: {text_mb:.1f} MB of text in {windowgpt_s:.1f} s wall "
      f"({text_mb / windowgpt_s:.1f} MB/s; {manifest['seconds']:.1f} s inside the stage)")
print(f"reference make_shards.py: {reference_s:.1f} s wall ({text_mb / reference_s:.1f} MB/s)")
same = True
for split in ("train", "val"):
    ours, theirs = stream(out / "windowgpt", split), stream(out / "reference", split)
    equal = ours.size == theirs.size and bool(np.array_equal(ours, theirs))
    same &= equal
    print(f"{split}: {ours.size:,} tokens in {len(manifest['splits'][split]['shards'])} shard(s) vs "
          f"{theirs.size:,}; streams equal: {equal}")
print("MATCH: identical token streams (train and val)" if same else "MISMATCH: token streams differ")
sys.exit(0 if same else 1)
EOF
