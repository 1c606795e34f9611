# Sourced by the bench scripts that take SHARED_DIR WORK_DIR LOG_DIR: sets shared, work,
# logs (absolute; work and logs created), repo and tok, exports PYTHONPATH, defines wg.
set -uo pipefail
shared=$(cd "$1" && pwd); mkdir -p "$2" "$3"; work=$(cd "$2" && pwd); logs=$(cd "$3" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
tok=$shared/data/tokenizers/fineweb_1024_bpe.model
wg() { python3 -m windowgpt_cli "$@"; }
# prepare_blogs DATA [TRAIN_FILES...]: the blog corpus (all training files, or those given)
# encoded with the sp1024 tokenizer into DATA, its log in $logs/prepare.log.
prepare_blogs() {
  local out=$1; shift
  local files=("$@"); [ ${#files[@]} -gt 0 ] || files=("$shared"/data/blogs/train_*.jsonl.xz)
  wg prepare "${files[@]}" --val "$shared/data/blogs/val.jsonl.xz" --tokenizer "$tok" --out "$out" \
    > "$logs/prepare.log" 2>&1 || { tail "$logs/prepare.log"; return 1; }
}
# train_record DATA RUN [FLAGS...]: the record model (windows of 512 + 4 sinks on layers
# 2,4,6,8,10) trained for TRAIN_SECONDS (default 240) with GPTQ's Hessians inside the budget.
train_record() {
  local data=$1 run=$2; shift 2
  wg train --data "$data" --out "$run" --window-attn-size 512 --num-sink-tokens 4 --window-attn-layers 2,4,6,8,10 \
    --max-wallclock-seconds "${TRAIN_SECONDS:-240}" --use-gptq --val-loss-every 0 --train-log-every 100 "$@" \
    > "$logs/train.log" 2>&1 || { tail -20 "$logs/train.log"; return 1; }
  tail -4 "$logs/train.log"
}
