# Sourced by the bench scripts that take SHARED_DIR WORK_DIR LOG_DIR: sets shared, work,
# logs (absolute; work and logs created), repo and tok, exports PYTHONPATH, defines wg.
set -uo pipefail
shared=$(cd "$1" && pwd); mkdir -p "$2" "$3"; work=$(cd "$2" && pwd); logs=$(cd "$3" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
tok=$shared/data/tokenizers/fineweb_1024_bpe.model
wg() { python3 -m windowgpt_cli "$@"; }
