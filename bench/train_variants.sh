#!/usr/bin/env bash
# One training step's GPU time by category (bench/train_profile.py --record) for several
# variants of the train flags, one after another on the same GPU and data, and a table
# that sets them side by side (bench/train_variants.py).
#   VARIANTS   "NAME:FLAGS;NAME:FLAGS..." (default: base, fused_mlp, gemm, fused_mlp_gemm: the
#              training step as is, with --fused-mlp, with --compile-tuning gemm, with both)
#   FLAGS      more flags for every variant (e.g. "--train-batch-tokens 131072" or
#              "--attn-backend triton_fa4")
# Each variant leaves LOG_DIR/NAME.json (train_profile.py's JSON) and LOG_DIR/NAME.log;
# LOG_DIR/train_variants.md holds the table.
# usage: [VARIANTS=...] [FLAGS=...] bench/train_variants.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
variants=${VARIANTS:-"base:;fused_mlp:--fused-mlp;gemm:--compile-tuning gemm;fused_mlp_gemm:--fused-mlp --compile-tuning gemm"}
[ -d "$work/data" ] || prepare_blogs "$work/data" || exit 1
IFS=';' read -r -a entries <<< "$variants"
for entry in "${entries[@]}"; do
  name=${entry%%:*} flags=${entry#*:}
  # shellcheck disable=SC2086  # the flags split into words
  python3 "$repo/bench/train_profile.py" --data "$work/data" --record --top 12 --json "$logs/$name.json" \
    ${FLAGS:-} $flags > "$logs/$name.log" 2>&1 || { echo "variant $name failed:"; tail -5 "$logs/$name.log"; }
done
python3 "$repo/bench/train_variants.py" "$logs" | tee "$logs/train_variants.md"
