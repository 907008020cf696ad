#!/usr/bin/env bash
# The server driven by a client nobody here wrote: the official `openai`
# Python package (PyPI, pinned) against the `serve` example with
# SmolLM2-135M-Instruct on the CPU (tests/openai_client/check_server.py).
#
#   scripts/openai-client-test.sh
#
# Skips, saying why, only when python3 or its pip / venv modules are
# missing. Uses the CARGO_TARGET_DIR of the caller.
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI="openai==3.63.0"
if ! command -v python3 >/dev/null 2>&1; then
  echo "openai-client-test: SKIPPED: python3 is not installed"
  exit 0
fi
if ! python3 -m pip --version >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then
  echo "openai-client-test: SKIPPED: python3 has no pip or venv module"
  exit 0
fi
venv="${XDG_CACHE_HOME:-$HOME/.cache}/candle-paged-attention/openai-venv"
if ! "$venv/bin/python" -c "import openai" >/dev/null 2>&1; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "$OPENAI"
fi

model="$(scripts/fetch-smollm2.sh)"
cargo build --release --features server --example serve
target="${CARGO_TARGET_DIR:-target}"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$(mktemp)"
"$target/release/examples/serve" "$model" --port "$port" --max-num-seqs 4 >"$log" 2>&1 &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; }
trap cleanup EXIT

for _ in $(seq 1 300); do
  if python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" 2>/dev/null; then
    break
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    cat "$log"; echo "openai-client-test: the server exited while starting"; exit 1
  fi
  sleep 1
done

status=0
"$venv/bin/python" tests/openai_client/check_server.py "http://127.0.0.1:$port/v1" || status=$?
kill -TERM "$pid"
server_status=0
wait "$pid" || server_status=$?
trap - EXIT
if [[ $status -ne 0 || $server_status -ne 0 ]]; then
  echo "--- server log"; cat "$log"
  echo "openai-client-test: FAILED (client exit $status, server exit $server_status after SIGTERM)"
  exit 1
fi
grep -c "^request " "$log" | xargs -I{} echo "openai-client-test: the server logged {} requests and exited 0 on SIGTERM"
echo "openai-client-test: passed"
