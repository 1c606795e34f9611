#!/usr/bin/env bash
# `eval` and `eval-ttt` against the reference on one host with two GPUs, same weights:
#   GPU 0  the reference: 200 steps at TRAIN_BATCH_TOKENS=131072 with TTT_ENABLED=1, so that
#          its log holds its int6 round trip, its stride-64 sliding evaluation and its
#          score-first TTT, each with its time (bench/eval_speed.py --cold times the two
#          sides' sliding evaluations in fresh processes)
#   GPU 1  the GPU tests; then windowgpt on the reference's int6 weights (`quantize
#          --no-gptq` reproduces them bit for bit): eval --stride 64, eval-ttt with the
#          reference's freezing and with windowgpt's, and eval --stride 64 again (its
#          compiled kernels now cached on disk; the first eval starts on empty caches)
# With SMOKE_GPU=1, GPU 1 first runs `make smoke-gpu` on the prepared data (while the
# reference trains); with WITH_TTT=0 neither side runs TTT. On a machine with one GPU the
# two sides run on it one after the other. Ends with a table.
#
# usage: [SMOKE_GPU=1] [WITH_TTT=0] bench/eval_checks.sh SHARED_DIR WORK_DIR LOG_DIR
#   SHARED_DIR holds seed/ (the reference, its shim and run_seed.sh) and data/ (blogs, tokenizer)
source "$(dirname "$0")/lib.sh"

prepare_blogs "$work/data"

with_ttt=${WITH_TTT:-1}
ours=1; [ "$(nvidia-smi -L | wc -l)" -lt 2 ] && ours=0

gpu0() {
  CUDA_VISIBLE_DEVICES=0 bash "$shared/seed/run_seed.sh" "$shared" "$work/ref" \
    TRAIN_BATCH_TOKENS=131072 ITERATIONS=200 MAX_WALLCLOCK_SECONDS=0 TTT_ENABLED=$with_ttt > /dev/null 2>&1
  cp "$work/ref/seed_log.txt" "$logs/reference.log"
}

gpu1() {
  if [ "${SMOKE_GPU:-0}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$ours make -C "$repo" smoke-gpu DATA="$work/data" SMOKE_OUT="$work/smoke" > "$logs/smoke.log" 2>&1
    echo "make smoke-gpu: exit $? ($(tail -c 2000 "$logs/smoke.log" | grep -c val_bpb) results)"
  fi
  CUDA_VISIBLE_DEVICES=$ours python3 -m pytest -q -m gpu "$repo/tests" -p no:cacheprovider --shared "$shared" 2>&1 | tail -3
  until grep -q "^Serialized model: " "$work/ref/seed_log.txt" 2>/dev/null; do sleep 2; done
  python3 "$repo/bench/reference_to_export.py" "$work/ref/final_model.pt" "$work/refexport" "$tok"
  CUDA_VISIBLE_DEVICES=$ours wg quantize "$work/refexport" --out "$work/ref_rtn.ptz" --no-gptq --compressor rans \
    > "$logs/quantize.log" 2>&1 || tail -3 "$logs/quantize.log"
  run1() { local name=$1; shift; CUDA_VISIBLE_DEVICES=$ours wg "$@" --data "$work/data" --json \
             > "$logs/$name.json" 2> "$logs/$name.err" || tail -3 "$logs/$name.err"; }
  # The first evaluation starts on empty compiler caches, as on a new machine.
  rm -rf "$work/caches"
  export TRITON_CACHE_DIR="$work/caches/triton" TORCHINDUCTOR_CACHE_DIR="$work/caches/inductor"
  run1 sliding_first eval "$work/ref_rtn.ptz" --stride 64
  if [ "$with_ttt" = 1 ]; then
    run1 ttt_reference_freezing eval-ttt "$work/ref_rtn.ptz" --no-ttt-freeze-bank-slices
    run1 ttt_bank_slices_frozen eval-ttt "$work/ref_rtn.ptz"
  fi
  run1 sliding_cached eval "$work/ref_rtn.ptz" --stride 64
}

if [ "$ours" = 1 ]; then
  gpu0 > "$logs/gpu0.log" 2>&1 &
  gpu1 > "$logs/gpu1.log" 2>&1 &
  wait
else
  gpu0 > "$logs/gpu0.log" 2>&1
  gpu1 > "$logs/gpu1.log" 2>&1
fi
cat "$logs/gpu0.log" "$logs/gpu1.log"

python3 - "$logs" <<'EOF'
import json, re, sys
from pathlib import Path
logs = Path(sys.argv[1])
ref = (logs / "reference.log").read_text(errors="replace") if (logs / "reference.log").exists() else ""

def ref_line(name):
    exact = re.search(rf"^{name}_exact val_loss:\S+ val_bpb:(\S+)", ref, re.M)
    timed = re.search(rf"^{name} val_loss:\S+ val_bpb:\S+ .*eval_time:(\d+)ms", ref, re.M)
    return (float(exact[1]) if exact else None), (int(timed[1]) / 1e3 if timed else None)

def ours(name):
    path = logs / f"{name}.json"
    if not path.exists():
        return None, None
    record = json.loads(path.read_text())
    return record["val_bpb"], record["seconds"]

fmt = lambda v, spec: format(v, spec) if v is not None else "-"
print(f"\n{'':<34} {'reference bpb':>14} {'windowgpt bpb':>14} {'|diff|':>9} {'ref s':>7} {'ours s':>7} {'speed-up':>8}")
rows = [("sliding s64", "final_int6_sliding_window", "sliding_first"),
        ("sliding s64 (kernels cached)", "final_int6_sliding_window", "sliding_cached"),
        ("ttt, the reference's freezing", "legal_ttt", "ttt_reference_freezing"),
        ("ttt, bank slices frozen too", "legal_ttt", "ttt_bank_slices_frozen")]
for label, ref_name, our_name in rows:
    (rb, rs), (ob, os_) = ref_line(ref_name), ours(our_name)
    diff = abs(rb - ob) if rb is not None and ob is not None else None
    speed = rs / os_ if rs and os_ else None
    print(f"{label:<34} {fmt(rb, '14.8f')} {fmt(ob, '14.8f')} {fmt(diff, '9.2e')} {fmt(rs, '7.1f')} "
          f"{fmt(os_, '7.1f')} {fmt(speed, '7.2f')}x")
EOF
