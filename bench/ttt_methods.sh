#!/usr/bin/env bash
# Sliding evaluation against score-first TTT by chunks (the reference's) and by per-document
# LoRA adapters, on the record model trained for TRAIN_SECONDS (default 240) on the blog corpus.
#   PHASE=train    prepare the data (sp1024), train (record windows, GPTQ's Hessians inside the
#                  budget), export, quantize (GPTQ, rans): WORK/model.ptz, WORK/data
#   PHASE=measure  eval --stride 64, eval-ttt, eval-ttt --method lora (and each of LORA_VARIANTS,
#                  "name:flags;name:flags") -> LOG_DIR/*.json and LOG_DIR/ttt_h200.json
#   (no PHASE: both). METHODS (default "sliding chunks lora") chooses the first three. MODEL
#   names the model in the JSON (default record_240s). Without its data, measure prepares the
#   validation split (and one training file) with the sp1024 tokenizer first.
#   PTZ: measure this .ptz (e.g. one carried from an earlier machine) instead of WORK/model.ptz;
#   DATA: score on this prepared data (e.g. bench/frontier.sh's WORK/data_sp8192 for a frontier
#   model) instead of WORK/data;
#   KEEP_PTZ=1: train also copies WORK/model.ptz into LOG_DIR (so that it outlives the machine).
#   DEADLINE_S: a LoRA run starts only while its estimate (LORA_ESTIMATE_S, default 240) fits
#   before DEADLINE_S seconds from the script's start (a device call's limit), so that no run
#   is cut off half way.
# usage: [PHASE=train|measure] [TRAIN_SECONDS=240] [LORA_VARIANTS=...] bench/ttt_methods.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
phase=${PHASE:-all}
model=${MODEL:-record_240s}
if [ "$phase" != measure ]; then
  prepare_blogs "$work/data" || exit 1
  train_record "$work/data" "$work/run" || exit 1
  wg export "$work/run" --out "$work/export" > "$logs/export.log" 2>&1 || { tail "$logs/export.log"; exit 1; }
  wg quantize "$work/export" --out "$work/model.ptz" --gptq --compressor rans --budget 100000000 \
    > "$logs/quantize.log" 2>&1 || { tail "$logs/quantize.log"; exit 1; }
  [ -n "${KEEP_PTZ:-}" ] && cp "$work/model.ptz" "$logs/model.ptz"
fi
if [ "$phase" != train ]; then
  if [ -n "${PTZ:-}" ]; then
    cp "$PTZ" "$work/model.ptz" || exit 1
  fi
  [ -f "$work/model.ptz" ] || { echo "no $work/model.ptz: run PHASE=train first (or give PTZ)"; exit 1; }
  data=${DATA:-$work/data}
  if [ ! -d "$data" ]; then  # a .ptz brought from elsewhere: the validation split is what is scored
    prepare_blogs "$data" "$shared/data/blogs/train_00.jsonl.xz" || exit 1
  fi
  run() {  # NAME ARGS...: one scoring command's JSON report, its log beside it
    local name=$1; shift
    if [[ -n ${DEADLINE_S:-} && $1 == eval-ttt && " $* " == *" lora "* ]] \
        && (( SECONDS + ${LORA_ESTIMATE_S:-240} > DEADLINE_S )); then
      echo "skipped $name: $(( DEADLINE_S - SECONDS ))s left before the deadline"; return 1
    fi
    wg "$@" --json > "$logs/$name.json" 2> "$logs/$name.log" || { tail "$logs/$name.log"; return 1; }
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['val_bpb'], r['seconds'])" \
      "$logs/$name.json" "$name"
  }
  methods=" ${METHODS:-sliding chunks lora} "
  [[ $methods == *" sliding "* ]] && run sliding eval "$work/model.ptz" --data "$data" --stride 64
  [[ $methods == *" chunks "* ]] && run chunks eval-ttt "$work/model.ptz" --data "$data" --method chunks
  [[ $methods == *" lora "* ]] && run lora eval-ttt "$work/model.ptz" --data "$data" --method lora
  IFS=';' read -ra variants <<< "${LORA_VARIANTS:-}"
  for variant in "${variants[@]}"; do
    # shellcheck disable=SC2086  # the flags split into words
    run "lora_${variant%%:*}" eval-ttt "$work/model.ptz" --data "$data" --method lora ${variant#*:}
  done
  python3 "$repo/bench/ttt_results.py" "$logs" --model "$model" --out "$logs/ttt_h200.json"
fi
