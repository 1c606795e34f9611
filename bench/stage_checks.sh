#!/usr/bin/env bash
# The stages against the reference on one host with two GPUs, side by side:
#   prepare   throughput on all cores, token streams against make_shards.py
#   GPU 0     the reference: 200 steps at TRAIN_BATCH_TOKENS=131072, then its own int6
#             round trip and stride-64 sliding evaluation; then its TTT against ours
#   GPU 1     windowgpt: the same 200 steps on the same shards with the reference's batch
#             order (--data-seed), then on the reference's weights: quantize (round to
#             nearest and GPTQ), eval (standard and stride 64), eval-ttt
#
# usage: bench/stage_checks.sh SHARED_DIR WORK_DIR LOG_DIR
#   SHARED_DIR holds seed/ (the reference, its shim and run_seed.sh) and data/ (blogs, tokenizer)
source "$(dirname "$0")/lib.sh"

bash "$repo/bench/prepare_throughput.sh" "$shared/data/blogs" "$tok" "$work/prep" "$shared/seed/make_shards.py" \
  > "$logs/prepare.log" 2>&1
ref_data=$work/ref/datasets/fineweb10B_sp1024
mkdir -p "$work/ref/datasets" && ln -sfn "$work/prep/reference" "$ref_data"
ours_data=$work/prep/windowgpt

gpu0() {
  CUDA_VISIBLE_DEVICES=0 bash "$shared/seed/run_seed.sh" "$shared" "$work/ref" \
    TRAIN_BATCH_TOKENS=131072 ITERATIONS=200 MAX_WALLCLOCK_SECONDS=0 > /dev/null 2>&1
  echo "== reference TTT against windowgpt's (the reference's freezing), same weights"
  CUDA_VISIBLE_DEVICES=0 python3 "$repo/bench/eval_speed.py" --reference-model "$work/ref/final_model.pt" \
    --data "$ref_data" --tokenizer "$tok" --seed-dir "$shared/seed" --what ttt --ttt-chunks 60 2>&1 | grep -v "^W1\|^ "
}

gpu1() {
  # The reference seeds its sampler with a hash of the shard paths it globs.
  data_seed=$(python3 "$repo/bench/reference_seed.py" "$ref_data")
  echo "== windowgpt train, 200 steps, reference batch order (--data-seed $data_seed)"
  CUDA_VISIBLE_DEVICES=1 wg train --data "$ref_data" --tokenizer "$tok" --out "$work/ours" --data-seed "$data_seed" \
    --train-batch-tokens 131072 --iterations 200 --max-wallclock-seconds 0 --val-loss-every 0 --train-log-every 50 \
    > "$logs/ours_train.log" 2>&1
  until grep -q "^Serialized model: " "$work/ref/seed_log.txt" 2>/dev/null; do sleep 2; done
  python3 "$repo/bench/reference_to_export.py" "$work/ref/final_model.pt" "$work/refexport" "$tok"
  for mode in rtn gptq; do
    flag=$([ $mode = gptq ] && echo "--gptq --data $ours_data" || echo "--no-gptq")
    echo "== quantize ($mode) the reference's weights"
    CUDA_VISIBLE_DEVICES=1 wg quantize "$work/refexport" --out "$work/ref_$mode.ptz" $flag 2>&1 | tail -14
    CUDA_VISIBLE_DEVICES=1 wg eval "$work/ref_$mode.ptz" --data "$ours_data" --stride 0 --json
  done
  echo "== eval stride 64 of the round-to-nearest artifact (the reference's int6 weights, bit for bit)"
  CUDA_VISIBLE_DEVICES=1 wg eval "$work/ref_rtn.ptz" --data "$ours_data" --stride 64 --json
  echo "== eval-ttt on the reference's weights, first blocks' bank slices frozen (windowgpt's default)"
  CUDA_VISIBLE_DEVICES=1 wg eval-ttt "$work/refexport" --data "$ours_data" --json 2>&1 | tail -3
}

gpu0 > "$logs/gpu0.log" 2>&1 &
gpu1 > "$logs/gpu1.log" 2>&1 &
wait
cp "$work/ref/seed_log.txt" "$logs/reference.log" 2>/dev/null
python3 "$repo/bench/compare_logs.py" --reference "$logs/reference.log" --ours "$logs/ours_train.log"
