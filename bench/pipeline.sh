#!/usr/bin/env bash
# Each command of the record chain timed as a whole process, run as a user runs it (one GPU,
# `python3 -m windowgpt_cli`, no torchrun), against the work the command itself reports:
#   prepare     data/blogs with the sp1024 tokenizer
#   train       the record model (windows of 512, 4 sink tokens, layers 2,4,6,8,10),
#               TRAIN_SECONDS of wallclock (default 30), GPTQ's calibration inside it
#   export, quantize --gptq, eval --stride 64, eval-ttt (3 epochs, the default)
#   smoke_gpu   `make smoke-gpu` on the same data: the whole record chain
# twice: pass "cold" gives every command its own fresh, empty Inductor and Triton cache
# folders (WORK_DIR/cache/COMMAND); pass "warm" runs each command again on its folders, now
# filled. Python's bytecode, where windowgpt keeps it itself (an installation that writes
# none, see windowgpt_cli/bytecode.py), goes to WORK_DIR/cache/python, emptied when the cold
# pass starts: its first command compiles the modules it imports, later ones read them. Each pass prepares its own data folder: prepare compiles nothing, so its two runs
# differ only by what the OS has cached. A command that fails ends its pass's chain (not
# smoke_gpu, which needs only the data).
# Writes LOG_DIR/PASS/COMMAND.{wall_s,rc,cache_files,log} and the stages' own reports, then
# bench/pipeline_report.py writes LOG_DIR/pipeline.json and RESULT (default
# bench/results/pipeline_h200.json) and prints the table.
#
# On one H200: the two passes without smoke_gpu take about 6 minutes, smoke_gpu's two
# passes about 5 more; run them as two commands and merge their logs with
# `python3 bench/pipeline_report.py LOGS_A LOGS_B --out bench/results/pipeline_h200.json`.
#
# usage: [PASSES="cold warm"] [COMMANDS="prepare train export quantize eval eval_ttt smoke_gpu"]
#        [SKIP_SMOKE=1] [TRAIN_SECONDS=30] [DEADLINE_S=570] [MODEL=record|full] [RESULT=FILE]
#        [PYTHON=python3] [TINY=1] bench/pipeline.sh SHARED_DIR WORK_DIR LOG_DIR
#   MODEL=full runs the chain (smoke_gpu too) with full attention on every layer instead of
#   the record's windows; RESULT then defaults to bench/results/pipeline_full_h200.json.
#   SHARED_DIR holds data/ (blogs, tokenizers). DEADLINE_S: no command starts, or runs on,
#   past this many seconds (0: no limit). TINY=1: a check of this script on the CPU, with
#   --preset tiny on data/demo/gutenberg_1mb.jsonl (SHARED_DIR unused; no RESULT by default).
source "$(dirname "$0")/lib.sh"
passes=${PASSES:-cold warm}
commands=${COMMANDS:-prepare train export quantize eval eval_ttt smoke_gpu}
[ "${SKIP_SMOKE:-0}" = 1 ] && commands=${commands//smoke_gpu/}
deadline=${DEADLINE_S:-570}
py=${PYTHON:-python3}
wgcmd=("$py" -m windowgpt_cli)
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export XDG_CACHE_HOME=$work/cache/python

if [ "${TINY:-0}" = 1 ]; then
  result=${RESULT:-}
  prepare_args=("$repo/data/demo/gutenberg_1mb.jsonl" --vocab-size 1024 --val-fraction 0.05)
  train_args=(--preset tiny --iterations 10 --use-gptq)
  smoke_args=("RECORD_FLAGS=--preset tiny --use-gptq" "SMOKE_FLAGS=--iterations 5")
else
  case ${MODEL:-record} in
    record) model_args=(--window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10)
            result=${RESULT-$repo/bench/results/pipeline_h200.json}
            smoke_args=() ;;
    full) model_args=()
          result=${RESULT-$repo/bench/results/pipeline_full_h200.json}
          smoke_args=("RECORD_MODEL_FLAGS=") ;;
    *) echo "MODEL: ${MODEL} is neither record nor full"; exit 2 ;;
  esac
  prepare_args=("$shared"/data/blogs/train_*.jsonl.xz --val "$shared/data/blogs/val.jsonl.xz" --tokenizer "$tok")
  train_args=("${model_args[@]}" --max-wallclock-seconds "${TRAIN_SECONDS:-30}" --use-gptq)
fi

wanted() { [[ " $commands " == *" $1 "* ]]; }
count_files() { find "$1" -type f 2>/dev/null | wc -l | tr -d ' '; }

# timed PASS NAME STDOUT COMMAND...: runs COMMAND with NAME's cache folders (emptied first in
# the cold pass), its stdout into STDOUT and its stderr into LOG_DIR/PASS/NAME.log; writes
# NAME.wall_s (the whole process's seconds), NAME.rc and NAME.cache_files (files in the
# cache folders before and after). Returns COMMAND's exit status.
timed() {
  local pass=$1 name=$2 stdout=$3; shift 3
  local cache=$work/cache/$name dir=$logs/$pass limit=()
  [ "$pass" = cold ] && rm -rf "$cache"
  mkdir -p "$cache/inductor" "$cache/triton" "$dir"
  if [ "$deadline" -gt 0 ]; then
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 10 ]; then
      echo "skipped" > "$dir/$name.rc"
      echo "$pass $name: skipped (DEADLINE_S=$deadline reached at ${SECONDS}s)"
      return 1
    fi
    limit=(timeout -k 15 "$left")  # a stopped train writes its checkpoint first
  fi
  local before start end rc
  before=$(count_files "$cache")
  start=$(date +%s.%N)
  TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton "${limit[@]}" "$@" \
    > "$stdout" 2> "$dir/$name.log"
  rc=$?
  end=$(date +%s.%N)
  echo "$start $end" | awk '{printf "%.3f\n", $2 - $1}' > "$dir/$name.wall_s"
  echo "$rc" > "$dir/$name.rc"
  echo "$before $(count_files "$cache")" > "$dir/$name.cache_files"
  echo "$pass $name: exit $rc, $(cat "$dir/$name.wall_s") s (cache files at start: $before)"
  [ "$rc" = 0 ] || tail -3 "$dir/$name.log"
  return "$rc"
}

# chain PASS: the stages one after another, as separate commands, in WORK_DIR/PASS.
chain() {
  local pass=$1 w=$work/$1 dir=$logs/$1
  if wanted train; then
    rm -rf "$w/run"
    timed "$pass" train "$dir/train.out" "${wgcmd[@]}" train --data "$w/data" --out "$w/run" "${train_args[@]}" \
      || return 1
    cp "$w/run/summary.json" "$dir/train.summary.json"
  fi
  if wanted export; then
    timed "$pass" export "$dir/export.json" "${wgcmd[@]}" export "$w/run" --out "$w/export" --json || return 1
  fi
  if wanted quantize; then
    rm -f "$w/model.ptz" "$w/model.ptz.json"
    timed "$pass" quantize "$dir/quantize.out" "${wgcmd[@]}" quantize "$w/export" --out "$w/model.ptz" --gptq \
      || return 1
    cp "$w/model.ptz.json" "$dir/quantize.report.json"
  fi
  if wanted eval; then
    timed "$pass" eval "$dir/eval.json" "${wgcmd[@]}" eval "$w/model.ptz" --data "$w/data" --stride 64 --json \
      || return 1
  fi
  if wanted eval_ttt; then
    timed "$pass" eval_ttt "$dir/eval_ttt.json" "${wgcmd[@]}" eval-ttt "$w/model.ptz" --data "$w/data" --json \
      || return 1
  fi
}

# smoke PASS: `make smoke-gpu` on the pass's data; its stages' files are copied to LOG_DIR.
smoke() {
  local pass=$1 w=$work/$1 dir=$logs/$1
  rm -rf "$w/smoke" "$dir/smoke_gpu"
  timed "$pass" smoke_gpu "$dir/smoke_gpu.out" make -C "$repo" smoke-gpu RUN_PYTHON="$py" DATA="$w/data" \
    SMOKE_OUT="$w/smoke" "${smoke_args[@]}"
  mkdir -p "$dir/smoke_gpu"
  cp "$w/smoke/train/summary.json" "$w/smoke"/{model.ptz.json,eval.json,eval-ttt.json,record.json} \
    "$w/smoke"/*.wall_s "$dir/smoke_gpu/" 2>/dev/null
}

"$py" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" \
  > "$logs/gpu.txt" 2>/dev/null
echo "device: $(cat "$logs/gpu.txt"); passes: $passes; commands: $commands"
for pass in $passes; do
  case $pass in cold | warm) ;; *) echo "PASSES: $pass is neither cold nor warm"; exit 2 ;; esac
  mkdir -p "$work/$pass" "$logs/$pass"
  [ "$pass" = cold ] && rm -rf "$work/cache/python"
  # prepare, timed when asked for, else only when the pass has no data yet
  if wanted prepare || [ ! -f "$work/$pass/data/manifest.json" ]; then
    rm -rf "$work/$pass/data"
    timed "$pass" prepare "$logs/$pass/prepare.json" "${wgcmd[@]}" prepare "${prepare_args[@]}" \
      --out "$work/$pass/data" --json || continue
    wanted prepare || rm -f "$logs/$pass"/prepare.*
  fi
  chain "$pass" || echo "$pass: the chain stopped"
  wanted smoke_gpu && smoke "$pass"
done

out_args=(--out "$logs/pipeline.json")
[ -n "$result" ] && out_args+=(--out "$result")
"$py" "$repo/bench/pipeline_report.py" "$logs" "${out_args[@]}"
