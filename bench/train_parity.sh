#!/usr/bin/env bash
# Training parity and step time against the reference, on the same shards and GPU type.
#
# usage: bench/train_parity.sh SHARED_DIR WORK_DIR [GPU_REF GPU_OURS]
#   SHARED_DIR  a folder holding seed/ (the reference and its run_seed.sh) and data/ (blogs, tokenizer)
#   WORK_DIR    where shards, logs and runs go
#   GPU_REF/GPU_OURS  CUDA device indices; the same index runs the two one after the other,
#               different indices run them side by side (default 0 0)
# Runs (a) 200 iterations at TRAIN_BATCH_TOKENS=131072 without a wallclock cap for both, and
# (b) the default configuration (786,432 tokens/step) for STEP_ITERS steps (default 40) for
# both, then prints train_loss at steps 50/100/200, the final val_bpb, and step_avg.
set -euo pipefail
shared=$(cd "$1" && pwd); work=$2; gpu_ref=${3:-0}; gpu_ours=${4:-0}
step_iters=${STEP_ITERS:-40}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work"; work=$(cd "$work" && pwd)
data=$work/datasets/fineweb10B_sp1024
tok=$work/tokenizers/fineweb_1024_bpe.model
common=(VAL_LOSS_EVERY=0 TRAIN_LOG_EVERY=50 EVAL_SEQ_LEN=64)  # EVAL_SEQ_LEN=64 skips the reference's post-training sliding eval

reference() {  # name, extra settings...
  local name=$1; shift
  mkdir -p "$work/ref_$name"
  cp -r "$work/datasets" "$work/tokenizers" "$work/ref_$name/" 2>/dev/null || true
  CUDA_VISIBLE_DEVICES=$gpu_ref bash "$shared/seed/run_seed.sh" "$shared" "$work/ref_$name" "${common[@]}" "$@" \
    > "$work/ref_$name.log" 2>&1
}
ours() {  # name, flags...
  local name=$1; shift
  rm -rf "$work/ours_$name"
  CUDA_VISIBLE_DEVICES=$gpu_ours PYTHONUNBUFFERED=1 PYTHONPATH="$repo" python3 -m windowgpt_cli train \
    --data "$data" --tokenizer "$tok" --out "$work/ours_$name" --val-loss-every 0 --train-log-every 50 "$@" \
    > "$work/ours_$name.log" 2>&1
}

# Shards once, with the reference's own tokenizing script.
if [ ! -f "$data/fineweb_val_000000.bin" ]; then
  mkdir -p "$work/tokenizers"; cp "$shared/data/tokenizers/fineweb_1024_bpe.model" "$work/tokenizers/"
  python3 "$shared/seed/make_shards.py" "$shared/data/blogs" "$data" "$tok" > "$work/shards.log"
fi

run_pair() {  # name, reference settings (one string), our flags (one string)
  if [ "$gpu_ref" = "$gpu_ours" ]; then
    reference "$1" $2; ours "$1" $3
  else
    reference "$1" $2 & ours "$1" $3 & wait
  fi
}
run_pair parity "TRAIN_BATCH_TOKENS=131072 ITERATIONS=200 MAX_WALLCLOCK_SECONDS=0" \
  "--train-batch-tokens 131072 --iterations 200 --max-wallclock-seconds 0"
run_pair steptime "ITERATIONS=$step_iters MAX_WALLCLOCK_SECONDS=0 TRAIN_LOG_EVERY=10" \
  "--iterations $step_iters --max-wallclock-seconds 0 --train-log-every 10"

python3 "$repo/bench/compare_logs.py" "$work"
