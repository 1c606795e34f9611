#!/usr/bin/env bash
# Two GPUs against one, with torchrun and NCCL, on one host:
#   1. one GPU, 100 steps, 8 micro-batches per step (global batch 786,432 tokens)
#   2. two GPUs, 100 steps, 4 micro-batches per rank per step (the same global batch)
#   3. train_loss at step 100 and tokens/s per GPU, side by side
#   4. `eval` of run 1 on one rank and on two (standard, and sliding at stride STRIDE)
#   5. mixed lengths on two GPUs (rank 0 at 2048, rank 1 at 6144): MIXED_STEPS steps,
#      stopped half-way and resumed
#
# usage: [PARTS=train,eval,mixed] bench/multi_gpu.sh DATA_DIR WORK_DIR LOG_DIR
#   DATA_DIR holds fineweb_{train,val}_*.bin and tokenizer.model (`windowgpt prepare`'s output);
#   PARTS picks steps 1-3 (train), 4 (eval of EVAL_RUN, default run 1) and 5 (mixed)
set -uo pipefail
data=$(cd "$1" && pwd); mkdir -p "$2" "$3"; work=$(cd "$2" && pwd); logs=$(cd "$3" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # optional packages (flash-attn-4) stay reachable
STEPS=${STEPS:-100} STRIDE=${STRIDE:-256} MIXED_STEPS=${MIXED_STEPS:-30} PARTS=${PARTS:-train,eval,mixed}
part() { [[ ",$PARTS," == *",$1,"* ]]; }
run2() { python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m windowgpt_cli "$@"; }
common=(--data "$data" --iterations "$STEPS" --max-wallclock-seconds 0 --val-loss-every 0 --train-log-every 10)

if part train; then
rm -rf "$work/one" "$work/two"
echo "== 1 GPU, $STEPS steps, 8 micro-batches"
CUDA_VISIBLE_DEVICES=0 python3 -m windowgpt_cli train "${common[@]}" --out "$work/one" --grad-accum-steps 8 \
  > "$logs/one.log" 2>&1 || tail -5 "$logs/one.log"
echo "== 2 GPUs, $STEPS steps, 4 micro-batches per rank"
run2 train "${common[@]}" --out "$work/two" --grad-accum-steps 4 > "$logs/two.log" 2>&1 || tail -5 "$logs/two.log"

python3 - "$logs/one.log" "$logs/two.log" "$STEPS" <<'EOF'
import re, sys
pattern = re.compile(r"step:(\d+)/\d+ train_loss:([\d.]+) train_time:\d+ms step_avg:([\d.]+)ms")
runs = {}
for label, path in (("1 GPU", sys.argv[1]), ("2 GPUs", sys.argv[2])):
    runs[label] = {int(m[1]): (float(m[2]), float(m[3])) for m in pattern.finditer(open(path).read())}
step, tokens = int(sys.argv[3]), 786_432
(loss1, ms1), (loss2, ms2) = runs["1 GPU"][step], runs["2 GPUs"][step]
print(f"train_loss@{step}: 1 GPU {loss1:.4f}  2 GPUs {loss2:.4f}  |diff| {abs(loss1 - loss2):.4f}")
per_gpu1, per_gpu2 = tokens / ms1 * 1e3, tokens / ms2 * 1e3 / 2
print(f"tokens/s per GPU: 1 GPU {per_gpu1:,.0f} ({ms1:.1f} ms/step)  2 GPUs {per_gpu2:,.0f} ({ms2:.1f} ms/step)  "
      f"ratio {per_gpu2 / per_gpu1:.3f}")
EOF
fi

if part eval; then
run=${EVAL_RUN:-$work/one}
echo "== eval of $run on one rank and on two"
for stride in 0 "$STRIDE"; do
  CUDA_VISIBLE_DEVICES=0 python3 -m windowgpt_cli eval "$run" --data "$data" --stride "$stride" --json \
    > "$logs/eval1_$stride.json" 2> "$logs/eval1_$stride.err"
  run2 eval "$run" --data "$data" --stride "$stride" --json > "$logs/eval2_$stride.json" 2> "$logs/eval2_$stride.err"
  python3 - "$logs/eval1_$stride.json" "$logs/eval2_$stride.json" "$stride" <<'EOF'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:3])
print(f"eval stride {sys.argv[3]}: 1 rank val_bpb {one['val_bpb']:.9f} ({one['seconds']:.1f}s)  "
      f"2 ranks {two['val_bpb']:.9f} ({two['seconds']:.1f}s)  |diff| {abs(one['val_bpb'] - two['val_bpb']):.2e}  "
      f"tokens {one['tokens']} / {two['tokens']}")
EOF
done
fi

if part mixed; then
rm -rf "$work/mixed"
echo "== mixed lengths: rank 0 at 2048, rank 1 at 6144, stopped at $((MIXED_STEPS / 2)) and resumed"
run2 train --data "$data" --out "$work/mixed" --iterations "$MIXED_STEPS" --max-wallclock-seconds 0 \
  --val-loss-every 0 --train-log-every 5 --train-seq-len-long 6144 --num-gpus-long 1 \
  --stop-at-step $((MIXED_STEPS / 2)) > "$logs/mixed.log" 2>&1 || tail -5 "$logs/mixed.log"
run2 train --out "$work/mixed" --resume >> "$logs/mixed.log" 2>&1 || tail -5 "$logs/mixed.log"
grep -E "rank_seq_lens|^step:|resume|val_bpb" "$logs/mixed.log" | grep -v "^step:.*val_loss" | tail -12
fi
