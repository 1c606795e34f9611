#!/usr/bin/env bash
# The frontier preset (docs/usage.md) on the blog corpus: its own 8,192-token tokenizer, then
# TRAIN_SECONDS (default 240) of training, quantize (the preset's GPTQ, int7 embedding, LQER;
# rans unless COMPRESSOR), stride-64 sliding evaluation and the preset's LoRA TTT through
# bench/ttt_methods.sh's measure phase (MODEL=frontier_240s in LOG_DIR/ttt_h200.json).
#   PHASE=train    WORK/data (sp8192), WORK/run, WORK/export, WORK/model.ptz, LOG_DIR/quantize.json
#   PHASE=measure  bench/ttt_methods.sh PHASE=measure on WORK (sliding, chunks, lora)
# usage: [PHASE=train|measure] [TRAIN_SECONDS=240] bench/frontier.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
phase=${PHASE:-all}
if [ "$phase" != measure ]; then
  wg prepare "$shared"/data/blogs/train_*.jsonl.xz --val "$shared/data/blogs/val.jsonl.xz" --vocab-size 8192 \
    --out "$work/data" > "$logs/prepare.log" 2>&1 || { tail "$logs/prepare.log"; exit 1; }
  wg train --preset frontier --data "$work/data" --out "$work/run" --max-wallclock-seconds "${TRAIN_SECONDS:-240}" \
    --val-loss-every 0 --train-log-every 100 > "$logs/train.log" 2>&1 || { tail -20 "$logs/train.log"; exit 1; }
  tail -4 "$logs/train.log"
  wg export "$work/run" --out "$work/export" > "$logs/export.log" 2>&1 || { tail "$logs/export.log"; exit 1; }
  wg quantize "$work/export" --out "$work/model.ptz" --gptq --compressor "${COMPRESSOR:-rans}" --json \
    > "$logs/quantize.json" 2> "$logs/quantize.log" || { tail "$logs/quantize.log"; exit 1; }
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('bytes', r['total_bytes'], 'within', r['within_budget'])" \
    "$logs/quantize.json"
fi
if [ "$phase" != train ]; then
  PHASE=measure MODEL=${MODEL:-frontier_240s} bash "$repo/bench/ttt_methods.sh" "$shared" "$work" "$logs"
fi
