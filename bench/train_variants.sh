#!/usr/bin/env bash
# One training step's GPU time by category (bench/train_profile.py --record) for several
# variants of the train flags, one after another on the same GPU and data, and a table
# that sets them side by side (bench/train_variants.py).
#   VARIANTS   "NAME:FLAGS;NAME:FLAGS..." (default: base, fused_mlp, gemm, fused_mlp_gemm: the
#              training step as is, with --fused-mlp triton, with --compile-tuning gemm, with
#              both; "off:--fused-mlp off --fold-output-scales off --fused-head-prep off
#              --fused-xsa off" is the step without the four levers that auto turns on where
#              they run; "heads:--fused-head-prep off" the queries' and keys' per-head steps
#              left to the compiler, "xsa:--fused-xsa off" XSA and the output gate)
#   FLAGS      more flags for every variant (e.g. "--train-batch-tokens 131072" or
#              "--attn-backend triton_fa4")
#   PROFILE_FLAGS  the model every variant profiles (default "--record": the record model's
#              windows; "--preset frontier --recur-start-fraction 0" profiles the frontier
#              preset's step with its loop on, as after 35% of a run)
#   DATA       an existing data directory (default: WORK_DIR/data, the blog corpus encoded
#              with sp1024 the first time; the frontier preset wants sp8192 data)
#   TOP        kernels listed per category in each JSON (default 12)
# Each variant leaves LOG_DIR/NAME.json (train_profile.py's JSON) and LOG_DIR/NAME.log;
# LOG_DIR/train_variants.md holds the table.
# usage: [VARIANTS=...] [FLAGS=...] bench/train_variants.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
variants=${VARIANTS:-"base:;fused_mlp:--fused-mlp triton;gemm:--compile-tuning gemm;fused_mlp_gemm:--fused-mlp triton \
--compile-tuning gemm"}
if [ -n "${DATA:-}" ]; then
  data=$DATA; [ -d "$data" ] || { echo "DATA $data: no such directory"; exit 1; }
else
  data=$work/data; [ -d "$data" ] || prepare_blogs "$data" || exit 1
fi
read -r -a profile_flags <<< "${PROFILE_FLAGS---record}"
IFS=';' read -r -a entries <<< "$variants"
for entry in "${entries[@]}"; do
  name=${entry%%:*} flags=${entry#*:}
  # shellcheck disable=SC2086  # the flags split into words
  python3 "$repo/bench/train_profile.py" --data "$data" "${profile_flags[@]}" --top "${TOP:-12}" \
    --json "$logs/$name.json" ${FLAGS:-} $flags > "$logs/$name.log" 2>&1 \
    || { echo "variant $name failed:"; tail -5 "$logs/$name.log"; }
done
python3 "$repo/bench/train_variants.py" "$logs" | tee "$logs/train_variants.md"
