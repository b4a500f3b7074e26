#!/usr/bin/env bash
# Command 1 of the README: set up, build, and serve the default model.
# Extra arguments go to `superfluid serve` (e.g. --sessions DIR --socket PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
model=$(scripts/setup.sh | tail -n 1)
cargo build --bin superfluid
exec "$CARGO_TARGET_DIR/debug/superfluid" serve "$model" "$@"
