#!/usr/bin/env bash
# The record flow on one host with two GPUs, beside the reference:
#   GPU 0  `make smoke-gpu` on data/blogs, every stage run from the packed OUT/code.pyz:
#          training with GPTQ's calibration inside it, export, quantize from the run's
#          Hessians, eval, eval-ttt, and the record report
#   GPU 1  the reference with USE_GPTQ=1 and the same settings (200 steps of 131072 tokens,
#          no wallclock cap), stopped once it logs `gptq:calibrated ... layers in`
# Then prints both calibration lines, quantize's calibration line and the record report.
# Everything is cut at DEADLINE_S seconds (default 520) and what exists is printed.
#
# usage: [DEADLINE_S=520] bench/record_checks.sh SHARED_DIR WORK_DIR LOG_DIR
#   SHARED_DIR holds seed/ (the reference, its shim and run_seed.sh) and data/ (blogs, tokenizer)
source "$(dirname "$0")/lib.sh"
deadline=${DEADLINE_S:-520}

if [ ! -f "$work/data/manifest.json" ]; then
  prepare_blogs "$work/data" || exit 1
fi
echo "prepare: done at ${SECONDS}s"
# The reference reads the same shards: prepare writes make_shards.py's tokens, token for token.
mkdir -p "$work/ref/datasets" && ln -sfn "$work/data" "$work/ref/datasets/fineweb10B_sp1024"
rm -f "$work/ref/seed_log.txt"

set -m  # the reference runs in its own process group, so that it can be stopped whole
CUDA_VISIBLE_DEVICES=1 bash "$shared/seed/run_seed.sh" "$shared" "$work/ref" USE_GPTQ=1 ITERATIONS=200 \
  TRAIN_BATCH_TOKENS=131072 MAX_WALLCLOCK_SECONDS=0 WARMDOWN_ITERS=60 WINDOW_ATTN_SIZE=512 NUM_SINK_TOKENS=4 \
  WINDOW_ATTN_LAYERS=2,4,6,8,10 > "$logs/reference.out" 2>&1 &
ref_pid=$!
set +m
stop_reference() { kill -- "-$ref_pid" 2>/dev/null; wait "$ref_pid" 2>/dev/null; }
(
  until grep -q "^gptq:calibrated .* layers in" "$work/ref/seed_log.txt" 2>/dev/null; do
    kill -0 "$ref_pid" 2>/dev/null || exit 0
    sleep 2
  done
  kill -- "-$ref_pid" 2>/dev/null
) &
watcher=$!

rm -rf "$work/smoke"
CUDA_VISIBLE_DEVICES=0 timeout $((deadline - SECONDS)) make -C "$repo" smoke-gpu DATA="$work/data" \
  SMOKE_OUT="$work/smoke" > "$logs/smoke.log" 2>&1
echo "make smoke-gpu: exit $? at ${SECONDS}s"

# The reference has had as long as our whole chain; give it what is left, then stop it.
while kill -0 "$watcher" 2>/dev/null && [ $SECONDS -lt "$deadline" ]; do sleep 2; done
kill "$watcher" 2>/dev/null
stop_reference
cp "$work/ref/seed_log.txt" "$logs/reference.log" 2>/dev/null
cp "$work/smoke/train/train.log" "$logs/train.log" 2>/dev/null
cp "$work/smoke/record.json" "$work/smoke/README.md" "$work/smoke/model.ptz.json" "$logs/" 2>/dev/null

echo "== GPTQ calibration: windowgpt, inside training (GPU 0)"
grep -h "^gptq:\|^stopping_early\|^step:200/" "$work/smoke/train/train.log" 2>/dev/null || echo "(no training log)"
echo "== GPTQ calibration: the reference (GPU 1)"
grep -h "^gptq:" "$work/ref/seed_log.txt" 2>/dev/null || echo "(the reference did not reach calibration)"
echo "== quantize"
grep -h -A1 "^calibration:" "$logs/smoke.log" || echo "(quantize did not run)"
grep -h "^code:" "$logs/smoke.log" || echo "(quantize did not count its code)"
echo "== record report ($work/smoke/README.md)"
cat "$work/smoke/README.md" 2>/dev/null || { echo "(no report)"; tail -20 "$logs/smoke.log"; }
