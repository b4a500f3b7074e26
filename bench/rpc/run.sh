#!/usr/bin/env bash
# What a hop to an RPC server costs per token (docs/scale.md). One command:
#
#   bench/rpc/run.sh              # 5 runs
#   bench/rpc/run.sh --runs 3
#
# Builds llama.cpp's ggml-rpc-server (scripts/build-llama-tool.sh, cached) and
# superfluid (release), then runs bench/rpc/hops.py, which prints a markdown
# table and writes bench/results/rpc-<date>.json. SUPERFLUID=/path skips the
# superfluid build (e.g. the dev build, whose llama.cpp is optimised alike).
set -euo pipefail
cd "$(dirname "$0")/../.."
RPC_SERVER="$(scripts/build-llama-tool.sh ggml-rpc-server | tail -n1)"
. scripts/env.sh
if [[ -z "${SUPERFLUID:-}" ]]; then
    cargo build --release --bin superfluid >&2
    SUPERFLUID="$CARGO_TARGET_DIR/release/superfluid"
fi
exec python3 bench/rpc/hops.py --superfluid "$SUPERFLUID" --rpc-server "$RPC_SERVER" "$@"
