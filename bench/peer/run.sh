#!/usr/bin/env bash
# superfluid against llama.cpp's llama-server on the same model, threads and
# context, A/B alternated. One command:
#
#   bench/peer/run.sh                 # 5 runs of every workload
#   bench/peer/run.sh --quick         # 2 runs, a smoke test
#   bench/peer/run.sh --runs 7 --only decode,fanout
#
# Builds the peer (bench/peer/build-llama-server.sh; ~18 minutes on 2 cores
# the first time, cached in ~/.cache/superfluid/peer) and superfluid
# (release), then runs bench/peer/bench.py, which prints a markdown table
# and writes bench/results/peer-<date>.json. LLAMA_SERVER=/path skips the
# peer build; SUPERFLUID_TEST_MODEL picks another GGUF.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ -z "${LLAMA_SERVER:-}" ]]; then
    LLAMA_SERVER="$(bench/peer/build-llama-server.sh | tail -n1)"
fi
. scripts/env.sh
cargo build --release --bin superfluid >&2
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exec python3 bench/peer/bench.py --superfluid "$CARGO_TARGET_DIR/release/superfluid" \
    --llama-server "$LLAMA_SERVER" "$@"
