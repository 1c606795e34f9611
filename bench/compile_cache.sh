#!/usr/bin/env bash
# What `train --compile-cache` spares a fresh machine: the same training twice, each with
# empty Inductor and Triton caches of its own (as on a machine just started); the first
# writes the compile cache, the second starts from it. Prints both runs' warm-up and compile
# seconds and writes LOG_DIR/compile_cache.json
# {"gpu", "train_flags", "cache_bytes", "runs": {"cold", "from_cache": {"warmup_s", "compile_s",
# "compile_cache_lines"}}, "warmup_ratio"}.
#   TRAIN_FLAGS (default: the record model, 20 steps)   what to train (and so compile)
#   DATA (default: WORK/data, one training file of      prepared data
#         the blog corpus encoded with sp1024)
# usage: [TRAIN_FLAGS="..."] [DATA=DIR] bench/compile_cache.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
data=${DATA:-$work/data}
if [ ! -f "$data/manifest.json" ]; then
  prepare_blogs "$data" "$shared/data/blogs/train_00.jsonl.xz" || exit 1
fi
flags=${TRAIN_FLAGS:---window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10 --iterations 20}
cache=$work/compile.cache
rm -f "$cache"
for name in cold from_cache; do
  rm -rf "${work:?}/$name"
  # shellcheck disable=SC2086  # the flags are words
  TORCHINDUCTOR_CACHE_DIR=$work/$name/inductor TRITON_CACHE_DIR=$work/$name/triton \
    wg train --data "$data" --out "$work/$name/run" --val-loss-every 0 --compile-cache "$cache" $flags \
    > "$logs/$name.log" 2>&1 || { tail -20 "$logs/$name.log"; exit 1; }
  grep -h "compile_cache:" "$logs/$name.log"
done
python3 - "$work" "$logs/compile_cache.json" "$flags" <<'EOF'
import json, os, sys

work, out, flags = sys.argv[1:]
runs = {}
for name in ("cold", "from_cache"):
    summary = json.load(open(os.path.join(work, name, "run", "summary.json")))
    log = open(os.path.join(work, name, "run", "train.log")).read().splitlines()
    runs[name] = {"warmup_s": summary["timings_s"].get("warmup"), "compile_s": summary["compile_s"],
                  "compile_cache_lines": [line for line in log if line.startswith("compile_cache:")]}
cold, warm = runs["cold"]["warmup_s"], runs["from_cache"]["warmup_s"]
cache = os.path.join(work, "compile.cache")
try:
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
except ImportError:
    gpu = None
result = {"gpu": gpu, "train_flags": flags, "cache_bytes": os.path.getsize(cache) if os.path.exists(cache) else None,
          "runs": runs, "warmup_ratio": round(warm / cold, 3) if cold and warm is not None else None}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
for name, run in runs.items():
    print(f"{name}: warm-up {run['warmup_s']} s, compile {run['compile_s']} s")
print(f"warm-up from the cache / cold: {result['warmup_ratio']}; cache {result['cache_bytes']} bytes")
EOF
