#!/usr/bin/env bash
# Runs the ORS protocol tests of tests/tests/it/ors_environment.rs against the `openreward` SDK's
# own server (scripts/ors_arith_server.py: the loopback server's four environments), so the
# client is checked against the reference implementation, not only our loopback copy.
#
#   PYTHON=/path/to/python bash scripts/check_ors.sh     # needs `pip install openreward`
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import openreward.environments" 2>/dev/null || {
  echo "check_ors: $PYTHON has no openreward (pip install openreward)" >&2
  exit 2
}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
"$PYTHON" scripts/ors_arith_server.py "$PORT" >/tmp/ors-server-$PORT.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 0.2
done
# The tests that inject faults or count what the server saw use the loopback server either way.
ORS_URL="http://127.0.0.1:$PORT" cargo test -p grpo-tests --test it -- \
  --test-threads 1 "ors_environment::${1:-}"
