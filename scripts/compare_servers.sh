#!/usr/bin/env bash
# The same requests through this crate's server and, when MISTRALRS names its
# binary, mistral.rs's (`mistralrs serve`), one after the other, driven by
# scripts/openai_load.py (streamed /v1/completions, greedy).
#
#   scripts/compare_servers.sh MODEL.gguf DEVICE LEVELS [MAX_TOKENS] [REQUESTS_PER_CLIENT]
#     DEVICE: cpu or cuda; LEVELS: client counts, e.g. 1,8
#   env: SERVE (default target/release/examples/serve), MISTRALRS (unset: ours only),
#        MISTRALRS_PAGED (on CUDA, `--paged-attn` on (default) or off),
#        MISTRALRS_ARGS (more arguments for `mistralrs serve`),
#        OURS=0 (mistral.rs only), MAX_NUM_SEQS (default 64), PROMPT_WORDS (default 100)
#
# Each server starts on its own port, answers its levels, and is stopped
# before the next one starts. One JSON line per server and level.
set -euo pipefail
model="$1" device="$2" levels="$3" max_tokens="${4:-128}" per_client="${5:-2}"
here="$(cd "$(dirname "$0")" && pwd)"
serve="${SERVE:-$here/../target/release/examples/serve}"
seqs="${MAX_NUM_SEQS:-64}" words="${PROMPT_WORDS:-100}"
load() {
  python3 "$here/openai_load.py" --url "http://127.0.0.1:$1" --server "$2" --pid "$3" --clients "$levels" \
    --requests-per-client "$per_client" --max-tokens "$max_tokens" --prompt-words "$words" --wait 300
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

if [[ ${OURS:-1} != 0 ]]; then
  "$serve" "$model" --device "$device" --port 8101 --max-num-seqs "$seqs" > /tmp/compare-ours.log 2>&1 &
  pid=$!
  load 8101 candle-paged-attention "$pid" || tail -5 /tmp/compare-ours.log
  stop "$pid"
fi

if [[ -n "${MISTRALRS:-}" ]]; then
  dir="$(cd "$(dirname "$model")" && pwd)"
  args=(serve --token-source none --port 8102 --max-seqs "$seqs" --format gguf -m "$dir" -f "$(basename "$model")")
  if [[ $device == cpu ]]; then args+=(--cpu --dtype f32); else args+=(--paged-attn "${MISTRALRS_PAGED:-on}"); fi
  # shellcheck disable=SC2206 # word splitting of the extra arguments is wanted
  args+=(${MISTRALRS_ARGS:-})
  "$MISTRALRS" "${args[@]}" > /tmp/compare-mistralrs.log 2>&1 &
  pid=$!
  label="mistral.rs paged-attn ${MISTRALRS_PAGED:-on}${MISTRALRS_ARGS:+ $MISTRALRS_ARGS}"
  [[ $device == cpu ]] && label="mistral.rs${MISTRALRS_ARGS:+ $MISTRALRS_ARGS}"
  load 8102 "$label" "$pid" || tail -5 /tmp/compare-mistralrs.log
  stop "$pid"
fi
