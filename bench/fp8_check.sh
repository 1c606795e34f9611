#!/usr/bin/env bash
# FP8 against bf16 training: the record model (windows of 512 with 4 sink tokens on layers
# 2,4,6,8,10) trained twice for STEPS steps (default 400) of BATCH_TOKENS tokens (default
# 131,072) on the same batches, once as is and once with `--fp8`, both uncapped and
# validated only at the end. Compares the final val_bpb (the bar: FP8 within 0.005 of bf16)
# and the step time (ms_per_step of summary.json, over the whole run after warm-up).
# Writes LOG_DIR/{bf16,fp8}.log and summaries, prints the comparison and writes RESULT
# (default bench/results/fp8_h200.json):
#   {"gpu": NAME, "steps": N, "batch_tokens": N, "bf16": {"val_bpb": .., "ms_per_step": ..},
#    "fp8": {...}, "val_bpb_difference": fp8 - bf16, "step_ratio": fp8 / bf16}
#
# usage: [STEPS=400] [BATCH_TOKENS=131072] [RESULT=FILE] [TINY=1] bench/fp8_check.sh SHARED_DIR WORK_DIR LOG_DIR
#   SHARED_DIR holds data/ (blogs, tokenizers); WORK_DIR gets data/blogs (prepared once) and the runs.
#   TINY=1: a check of this script on the CPU, with --preset tiny on data/demo/gutenberg_1mb.jsonl
#   (SHARED_DIR unused; 4 steps; no RESULT by default).
source "$(dirname "$0")/lib.sh"
if [ "${TINY:-0}" = 1 ]; then
  steps=${STEPS:-4}; result=${RESULT:-}
  prepare_args=("$repo/data/demo/gutenberg_1mb.jsonl" --vocab-size 1024 --val-fraction 0.05)
  model_args=(--preset tiny)
else
  steps=${STEPS:-400}; result=${RESULT-$repo/bench/results/fp8_h200.json}
  prepare_args=("$shared"/data/blogs/train_*.jsonl.xz --val "$shared/data/blogs/val.jsonl.xz" --tokenizer "$tok")
  model_args=(--window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10
              --train-batch-tokens "${BATCH_TOKENS:-131072}")
fi
if [ ! -f "$work/data/manifest.json" ]; then
  wg prepare "${prepare_args[@]}" --out "$work/data" > "$logs/prepare.log" 2>&1 \
    || { tail -3 "$logs/prepare.log"; exit 1; }
fi
args=(--data "$work/data" "${model_args[@]}" --iterations "$steps" --max-wallclock-seconds 0 --val-loss-every 0)
for variant in bf16 fp8; do
  extra=(); [ "$variant" = fp8 ] && extra=(--fp8)
  rm -rf "$work/$variant"
  wg train "${args[@]}" "${extra[@]}" --out "$work/$variant" > "$logs/$variant.log" 2>&1 \
    || { echo "$variant: train failed"; tail -3 "$logs/$variant.log"; exit 1; }
  cp "$work/$variant/summary.json" "$logs/$variant.summary.json"
done
python3 - "$logs" "$work/bf16/config.json" "$result" <<'PY'
import json, sys
from pathlib import Path
logs, config, result = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3]
runs = {v: json.loads((logs / f"{v}.summary.json").read_text()) for v in ("bf16", "fp8")}
report = {"gpu": runs["bf16"]["devices"][0], "steps": runs["bf16"]["step"],
          "batch_tokens": config["train"]["train_batch_tokens"],
          **{v: {"val_bpb": r["val_bpb"], "ms_per_step": r["ms_per_step"]} for v, r in runs.items()}}
report["val_bpb_difference"] = runs["fp8"]["val_bpb"] - runs["bf16"]["val_bpb"]
report["step_ratio"] = runs["fp8"]["ms_per_step"] / runs["bf16"]["ms_per_step"]
print(f"val_bpb bf16 {report['bf16']['val_bpb']:.4f}, fp8 {report['fp8']['val_bpb']:.4f} "
      f"(difference {report['val_bpb_difference']:+.4f}, bar 0.005); ms/step bf16 "
      f"{report['bf16']['ms_per_step']:.1f}, fp8 {report['fp8']['ms_per_step']:.1f} (ratio {report['step_ratio']:.3f})")
if result:
    Path(result).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {result}")
PY
