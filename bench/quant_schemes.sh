#!/usr/bin/env bash
# The quantization schemes and compressors measured on the record model trained for
# TRAIN_SECONDS (default 240) on the blog corpus: bench/quant_schemes.py's table and JSON.
#   PHASE=train    prepare the data (sp1024), train (record windows, GPTQ's Hessians inside
#                  the budget, the output layer's too), export: WORK/data, WORK/run, WORK/export
#   PHASE=measure  bench/quant_schemes.py on WORK/export -> LOG_DIR/quant_h200.json
#   (no PHASE: both). On one H200 the two phases take about 6 and 9 minutes (4 with rans).
#   TRAIN_FLAGS: more train flags (e.g. --qat-start-fraction 0.5: the schemes on a model
#   trained with quantization-aware training); MODEL: how the JSON names the model
# usage: [PHASE=train|measure] [TRAIN_SECONDS=240] [TRAIN_FLAGS=...] [MODEL=...] [SCHEMES=a,b] [COMPRESSOR=auto|rans|...] bench/quant_schemes.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
phase=${PHASE:-all}
if [ "$phase" != measure ]; then
  prepare_blogs "$work/data" || exit 1
  # shellcheck disable=SC2086  # TRAIN_FLAGS split into words
  train_record "$work/data" "$work/run" --quant-gptq-embed ${TRAIN_FLAGS:-} || exit 1
  wg export "$work/run" --out "$work/export" > "$logs/export.log" 2>&1 || { tail "$logs/export.log"; exit 1; }
fi
if [ "$phase" != train ]; then
  [ -d "$work/export" ] || { echo "no $work/export: run PHASE=train first (on the same machine)"; exit 1; }
  python3 "$repo/bench/quant_schemes.py" "$work/export" --data "$work/data" --work "$work/schemes" \
    --out "$logs/quant_h200.json" ${SCHEMES:+--schemes "$SCHEMES"} ${MODEL:+--model "$MODEL"} --compressor "${COMPRESSOR:-auto}"
fi
