#!/usr/bin/env bash
# The default preset (the record's windows) against --preset frontier and the frontier preset
# without each of its three largest ideas, at an equal budget on the blog corpus: TRAIN_SECONDS
# (default 240) of training and GPTQ calibration, quantize --gptq (auto unless COMPRESSOR:
# the artifact one would submit), eval --stride 64. Each preset reads its own tokenizer's
# data: the shared sp1024 for default and frontier_sp1024, one trained by `prepare
# --vocab-size 8192` on the training split for the others (bits per byte compare across
# tokenizers).
#   RUNS (default: all, in this order)  default frontier frontier_sp1024 frontier_no_recur
#                                       frontier_no_parallel; on request also frontier_mix_order
#                                       (the preset compiled with Inductor's mix-order reductions)
#                                       frontier_fp8 (the preset with its attention's and MLP's
#                                       products in float8 while it trains) and frontier_fp8_mlp
#                                       (the MLP's alone, through its own activation kernels),
#                                       frontier_fp8_mlp_fa4 (that with FlashAttention-4 for
#                                       the full causal layers: PYTHONPATH must reach flash_attn),
#                                       frontier_fp8_mlp_no_recur (that without depth recurrence),
#                                       frontier_case_markers, frontier_no_split_scripts,
#                                       frontier_tokenizer, frontier_no_split_words and
#                                       frontier_sample_64mb (the preset on sp8192 data whose
#                                       tokenizer prepare trained with --case-markers,
#                                       --no-split-scripts, both, --no-split-words (pieces that
#                                       span words), or on 64 MiB of text instead of 4 MB),
#                                       frontier_reference_optim (the preset with the reference's
#                                       Muon momentum, weight decays and no row normalization),
#                                       frontier_reference_forms (the preset with the reference's
#                                       SmearGate and x0 in the parallel MLP's input)
#   TRAIN_FLAGS                         more train flags for every run (a smaller model to
#                                       check the script on a CPU)
#   SLIDING_UNQUANTIZED=1               also score the unquantized export (the quantization's
#                                       cost, both sliding)
#   EVAL_SEQ_LENS="3072 4096"           also score each .ptz with windows of these lengths
#                                       (stride 64; beyond training's length the rotary tables
#                                       stretch by the model's rope_scaling)
#   DEADLINE_S (default 570)            a run starts only while the estimate of its time
#                                       (RUN_ESTIMATE_S, default 400) fits before it
#   RESUME=1                            a run whose training finished in WORK (a call stopped
#                                       at its limit) keeps it: export, quantize and eval run
#   PACK_FLAGS (default --strip --lzma) pack's flags for the code counted
#   BUDGET (default 16000000)           quantize's --budget (over it a run stops after quantize)
#   COMPILE_CACHE                       train's --compile-cache for every run: a file of
#                                       torch.compile's caches that a fresh machine starts from
# Each run leaves LOG_DIR/NAME/{train.log,summary.json,quantize.json,eval.json} and WORK/NAME/
# {export,model.ptz} (bench/quant_schemes.py takes the export); quantize runs from the packed
# code, so the bytes count the code as `pack` writes it (LOG_DIR/packed_code_bytes) and a
# preset that fits its artifact into the budget aims at the budget less that code;
# LOG_DIR/frontier_h200.json collects them
# (bench/frontier_results.py merges several calls' logs into bench/results/frontier_h200.json).
# usage: [RUNS="..."] [TRAIN_SECONDS=240] bench/frontier.sh SHARED_DIR WORK_DIR LOG_DIR
source "$(dirname "$0")/lib.sh"
started=$SECONDS
runs=${RUNS:-default frontier frontier_sp1024 frontier_no_recur frontier_no_parallel}
record_windows=(--window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10 --use-gptq)
reference_optim=(--no-muon-row-normalize --muon-momentum 0.99 --muon-wd 0.04 --adam-wd 0.04 --embed-wd -1)

tokenizer_flags_for() {  # NAME -> prepare's tokenizer options for that run's sp8192 data
  case $1 in
    frontier_case_markers) echo "--case-markers" ;;
    frontier_no_split_scripts) echo "--no-split-scripts" ;;
    frontier_tokenizer) echo "--case-markers --no-split-scripts" ;;
    frontier_no_split_words) echo "--no-split-words" ;;
    frontier_sample_64mb) echo "--tokenizer-sample-bytes 67108864" ;;
  esac
}

data_for() {  # NAME -> the folder of that run's data, prepared once per call
  local options dir log
  case $1 in
    default|frontier_sp1024)
      [ -d "$work/data_sp1024" ] || prepare_blogs "$work/data_sp1024" || return 1
      echo "$work/data_sp1024" ;;
    *)
      read -r -a options <<< "$(tokenizer_flags_for "$1")"
      dir=$work/data_sp8192$(printf '%s' "${options[@]}" | tr -c 'a-z' '_') log=$logs/prepare_${dir##*/data_}.log
      if [ ! -d "$dir" ]; then
        wg prepare "$shared"/data/blogs/train_*.jsonl.xz --val "$shared/data/blogs/val.jsonl.xz" --vocab-size 8192 \
          "${options[@]}" --out "$dir" > "$log" 2>&1 || { tail "$log" >&2; return 1; }
      fi
      echo "$dir" ;;
  esac
}

flags_for() {  # NAME -> its train flags, one a line
  case $1 in
    default) printf '%s\n' "${record_windows[@]}" ;;
    frontier) printf '%s\n' --preset frontier ;;
    frontier_sp1024) printf '%s\n' --preset frontier --vocab-size 1024 ;;
    frontier_no_recur) printf '%s\n' --preset frontier --recur-layers "" --recur-count 1 ;;
    frontier_no_parallel) printf '%s\n' --preset frontier --parallel-start-layer 0 ;;
    frontier_mix_order) printf '%s\n' --preset frontier --compile-mix-order ;;
    frontier_fp8) printf '%s\n' --preset frontier --fp8-mlp --fp8-attention ;;
    frontier_fp8_mlp) printf '%s\n' --preset frontier --fp8-mlp ;;
    frontier_fp8_mlp_fa4) printf '%s\n' --preset frontier --fp8-mlp --attn-backend fa4 ;;
    frontier_fp8_mlp_no_recur) printf '%s\n' --preset frontier --fp8-mlp --recur-layers "" --recur-count 1 ;;
    frontier_reference_optim) printf '%s\n' --preset frontier "${reference_optim[@]}" ;;
    frontier_reference_forms) printf '%s\n' --preset frontier --smear-gate-width 0 --parallel-mlp-reads-x0 ;;
    frontier_case_markers|frontier_no_split_scripts|frontier_tokenizer|frontier_no_split_words|frontier_sample_64mb)
      printf '%s\n' --preset frontier ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

step() {  # LOG COMMAND ARGS...: one command, its output in LOG; the log's end on failure
  local log=$1; shift
  "$@" > "$log" 2> "${log%.*}.err" || { tail -n 20 "$log" "${log%.*}.err"; return 1; }
}

packed() { python3 "$work/code.pyz" "$@"; }  # the record's code, as pack wrote it for this call

measure() {  # NAME: train, export, quantize and evaluate one run
  local name=$1 data dir=$work/$1 out=$logs/$1 flags
  data=$(data_for "$name") || return 1
  mapfile -t flags < <(flags_for "$name") || return 1
  mkdir -p "$out"
  if [ -n "${RESUME:-}" ] && [ -f "$dir/run/summary.json" ] && [ -f "$out/train.log" ]; then
    echo "$name: training kept from $dir/run"
  else
    rm -rf "$dir"
    step "$out/train.log" wg train --data "$data" --out "$dir/run" --max-wallclock-seconds "${TRAIN_SECONDS:-240}" \
      --val-loss-every 0 --train-log-every 100 "${flags[@]}" ${TRAIN_FLAGS:-} \
      ${COMPILE_CACHE:+--compile-cache "$COMPILE_CACHE"} || return 1
  fi
  grep -hE "graphs_after_warmup|recurrence:|stopping_early|post_ema|compile_cache" "$out/train.log"
  cp "$dir/run/summary.json" "$dir/run/config.json" "$out/"
  step "$out/export.log" wg export "$dir/run" --out "$dir/export" || return 1
  # From the packed code: the report counts the code as the record does, and a preset that fits
  # its artifact into the budget (quant_fit_budget) aims at the budget less that code.
  step "$out/quantize.json" packed quantize "$dir/export" --out "$dir/model.ptz" --gptq \
    --compressor "${COMPRESSOR:-auto}" --budget "${BUDGET:-16000000}" --json || return 1
  step "$out/eval.json" wg eval "$dir/model.ptz" --data "$data" --stride 64 --json || return 1
  if [ -n "${SLIDING_UNQUANTIZED:-}" ]; then  # what quantization costs, both sliding
    step "$out/eval_unquantized.json" wg eval "$dir/export" --data "$data" --stride 64 --json || return 1
  fi
  for seq_len in ${EVAL_SEQ_LENS:-}; do
    step "$out/eval_seq$seq_len.json" wg eval "$dir/model.ptz" --data "$data" --stride 64 --seq-len "$seq_len" \
      --json || return 1
  done
  python3 "$repo/bench/frontier_results.py" "$logs" --out "$logs/frontier_h200.json" --only "$name"
}

# The record counts the code as `pack` writes it (a zipapp), not as source on disk.
wg pack ${PACK_FLAGS---strip --lzma} --out "$work/code.pyz" > "$logs/pack.log" 2>&1 || { tail "$logs/pack.log"; exit 1; }
stat -c %s "$work/code.pyz" > "$logs/packed_code_bytes"
for name in $runs; do
  left=$(( ${DEADLINE_S:-570} - (SECONDS - started) ))
  if [ "$left" -lt "${RUN_ESTIMATE_S:-400}" ]; then
    echo "skipped $name: ${left}s left before the deadline"; continue
  fi
  # TORCH_LOGS=recompiles: any step that recompiles after the warm-up says so in train.err
  TORCH_LOGS=recompiles measure "$name" || echo "run $name failed"
done
