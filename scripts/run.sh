#!/usr/bin/env bash
# Command 1 of the README: set up, build, and serve the default model.
# Extra arguments go to `superfluid serve` (e.g. --sessions DIR --socket PATH).
# The web listener (the session API as JSON, the OpenAI and Anthropic routes,
# /metrics) is on 127.0.0.1:8460, the Python client's default, unless the
# arguments name another --web.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
model=$(scripts/setup.sh | tail -n 1)
cargo build --bin superfluid
web=(--web 127.0.0.1:8460)
for a in "$@"; do
  case "$a" in --web|--web=*) web=() ;; esac
done
exec "$CARGO_TARGET_DIR/debug/superfluid" serve "$model" "${web[@]}" "$@"
