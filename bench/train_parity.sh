#!/usr/bin/env bash
# Training step time and parity against the reference, on the same shards and GPU type.
#
# usage: [CONFIGS=...] [STEP_ITERS=40] [PARITY_ITERS=200] [RESULT_JSON=PATH] [LOG_DIR=DIR]
#        bench/train_parity.sh SHARED_DIR WORK_DIR [GPU_REF GPU_OURS]
#   SHARED_DIR  a folder holding seed/ (the reference and its run_seed.sh) and data/ (blogs, tokenizer)
#   WORK_DIR    where shards and runs go (shards are made once per WORK_DIR and reused)
#   GPU_REF/GPU_OURS  CUDA device indices; the same index runs the two one after the other,
#               different indices run them side by side (default 0 0; e.g. 1 0 on a 2-GPU host)
#
# Each configuration runs the reference (through seed/run_seed.sh) and `windowgpt train`:
#   record_786k  the record model (windows of 512 with 4 sink tokens on layers 2,4,6,8,10),
#                786,432 tokens per step, STEP_ITERS steps
#   full_786k    full attention on every layer, 786,432 tokens per step, STEP_ITERS steps
#   record_131k  the record model, 131,072 tokens per step, STEP_ITERS steps
#   parity       the record model, 131,072 tokens per step, PARITY_ITERS steps, windowgpt on
#                the reference's batches in its order (--data-seed from bench/reference_seed.py)
# Step time is the mean over steps 11..last (from the logs' cumulative step_avg). Without a
# record_131k run of its own, record_131k's step time is read from the parity run (the same
# model and batch, over steps 11..PARITY_ITERS). CONFIGS (comma-separated) picks the runs,
# default record_786k,full_786k,parity, so that a long session can be split over calls.
# OURS_FLAGS: more `windowgpt train` flags for every windowgpt run (e.g. "--fused-mlp off").
# STOP_AFTER_TRAINING=1 (default) stops each process once its log holds what is compared
# (the last step's train_loss, or for parity the final validation), skipping the reference's
# quantization and evaluation that follow training.
#
# Logs: LOG_DIR (default WORK_DIR/logs) gets ref_NAME.log, ours_NAME.log and gpu.txt;
# bench/compare_logs.py writes RESULT_JSON (default bench/results/train_step_h200.json; see
# compare_logs.py for its shape) after each pair, and prints a markdown table at the end.
set -euo pipefail
shared=$(cd "$1" && pwd); mkdir -p "$2"; work=$(cd "$2" && pwd); gpu_ref=${3:-0}; gpu_ours=${4:-0}
repo=$(cd "$(dirname "$0")/.." && pwd)
CONFIGS=${CONFIGS:-record_786k,full_786k,parity}
STEP_ITERS=${STEP_ITERS:-40} PARITY_ITERS=${PARITY_ITERS:-200} STOP_AFTER_TRAINING=${STOP_AFTER_TRAINING:-1}
RESULT_JSON=${RESULT_JSON:-$repo/bench/results/train_step_h200.json}
logs=${LOG_DIR:-$work/logs}; mkdir -p "$logs"; logs=$(cd "$logs" && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # optional packages (flash-attn-4) stay reachable
data=$work/datasets/fineweb10B_sp1024
tok=$shared/data/tokenizers/fineweb_1024_bpe.model
# EVAL_SEQ_LEN=64 skips the reference's sliding evaluation after training (validation still runs at 2048).
common_ref=(VAL_LOSS_EVERY=0 EVAL_SEQ_LEN=64)
record_ref=(WINDOW_ATTN_SIZE=512 NUM_SINK_TOKENS=4 WINDOW_ATTN_LAYERS=2,4,6,8,10)
record_ours=(--window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10)
# The reference's EMA has no warm-up; windowgpt's only departure in an uncapped run.
common_ours=(--val-loss-every 0 --max-wallclock-seconds 0 --no-ema-warmup)
read -r -a extra_ours <<< "${OURS_FLAGS:-}"
common_ours+=("${extra_ours[@]}")

wanted() { [[ ",$CONFIGS," == *",$1,"* ]]; }

# Shards once, with the reference's own tokenizing script, and a manifest for windowgpt.
if [ ! -f "$data/manifest.json" ]; then
  mkdir -p "$data"
  python3 "$shared/seed/make_shards.py" "$shared/data/blogs" "$data" "$tok" > "$work/shards.log"
  python3 -m windowgpt_cli prepare --index "$data" --tokenizer "$tok" >> "$work/shards.log"
fi
nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu_ours" > "$logs/gpu.txt" 2>/dev/null || rm -f "$logs/gpu.txt"

# run_until MARKER LOG COMMAND...: COMMAND in its own process group, its output in LOG; with
# STOP_AFTER_TRAINING=1 the group is killed once LOG holds MARKER.
run_until() {
  local marker=$1 log=$2; shift 2
  ( set -m
    "$@" > "$log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
      if [ "$STOP_AFTER_TRAINING" = 1 ] && grep -qs -- "$marker" "$log"; then
        kill -KILL -- "-$pid" 2>/dev/null || true
        break
      fi
      sleep 2
    done
    wait "$pid" 2>/dev/null || true )
}

# The reference of run NAME reads the shared shards through WORK_DIR/ref_NAME/datasets/...,
# the path (as given, not resolved) from which it seeds its batch sampler.
link_ref_data() {  # NAME: prints that path
  mkdir -p "$work/ref_$1/datasets" && ln -sfn "$data" "$work/ref_$1/datasets/fineweb10B_sp1024"
  echo "$work/ref_$1/datasets/fineweb10B_sp1024"
}
reference() {  # NAME SETTINGS...: run_seed.sh in WORK_DIR/ref_NAME
  local name=$1; shift
  link_ref_data "$name" > /dev/null
  CUDA_VISIBLE_DEVICES=$gpu_ref bash "$shared/seed/run_seed.sh" "$shared" "$work/ref_$name" "${common_ref[@]}" "$@"
}
ours() {  # NAME FLAGS...
  local name=$1; shift
  rm -rf "$work/ours_$name"
  CUDA_VISIBLE_DEVICES=$gpu_ours python3 -m windowgpt_cli train --data "$data" --tokenizer "$tok" \
    --out "$work/ours_$name" "${common_ours[@]}" "$@"
}

# run_pair NAME MARKER "REFERENCE SETTINGS" "OUR FLAGS" (each one string, split on spaces)
run_pair() {
  local name=$1 marker=$2
  echo "== $name: reference on GPU $gpu_ref, windowgpt on GPU $gpu_ours ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086
  if [ "$gpu_ref" = "$gpu_ours" ]; then
    run_until "$marker" "$logs/ref_$name.log" reference "$name" $3
    run_until "$marker" "$logs/ours_$name.log" ours "$name" $4
  else
    run_until "$marker" "$logs/ref_$name.log" reference "$name" $3 &
    run_until "$marker" "$logs/ours_$name.log" ours "$name" $4 &
    wait
  fi
  for log in "$logs/ref_$name.log" "$logs/ours_$name.log"; do
    grep -qs -- "$marker" "$log" || { echo "   $(basename "$log") never logged '$marker'; its end:"; tail -n 5 "$log"; }
  done
  # RESULT_JSON after every pair (the runs still to come null): a call stopped at its time
  # limit keeps what it measured.
  python3 "$repo/bench/compare_logs.py" "$logs" --json "$RESULT_JSON" > /dev/null || true
}

step_run() {  # NAME "REFERENCE SETTINGS" "OUR FLAGS": STEP_ITERS steps, logged every 10
  run_pair "$1" "step:$STEP_ITERS/$STEP_ITERS train_loss" \
    "$2 ITERATIONS=$STEP_ITERS MAX_WALLCLOCK_SECONDS=0 TRAIN_LOG_EVERY=10" \
    "$3 --iterations $STEP_ITERS --train-log-every 10"
}

wanted record_786k && step_run record_786k "${record_ref[*]}" "${record_ours[*]}"
wanted full_786k && step_run full_786k "" ""
wanted record_131k && step_run record_131k "${record_ref[*]} TRAIN_BATCH_TOKENS=131072" \
  "${record_ours[*]} --train-batch-tokens 131072"
if wanted parity; then
  data_seed=$(python3 "$repo/bench/reference_seed.py" "$(link_ref_data parity)")
  run_pair parity "peak memory allocated" \
    "${record_ref[*]} TRAIN_BATCH_TOKENS=131072 ITERATIONS=$PARITY_ITERS MAX_WALLCLOCK_SECONDS=0 TRAIN_LOG_EVERY=50" \
    "${record_ours[*]} --train-batch-tokens 131072 --iterations $PARITY_ITERS --train-log-every 50 --data-seed $data_seed"
fi

echo "== done ($(date -u +%H:%M:%S))"
python3 "$repo/bench/compare_logs.py" "$logs" --json "$RESULT_JSON"
