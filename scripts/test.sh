#!/usr/bin/env bash
# Command 2 of the README: run every test, on the real default model.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
model=$(scripts/setup.sh | tail -n 1)
export SUPERFLUID_TEST_MODEL="$model"
# llama.cpp's RPC server, for tests/tests/rpc.rs (`serve --rpc`): built from
# the same llama.cpp source as the benchmark peer (a minute or two, once).
SUPERFLUID_RPC_SERVER=$(scripts/build-llama-tool.sh ggml-rpc-server | tail -n 1)
export SUPERFLUID_RPC_SERVER
# The suites run many daemons at once on few cores: OpenMP's spinning wait
# (the default, and the fastest for one daemon) thrashes when oversubscribed,
# so the daemons under test sleep at their barriers instead.
export OMP_WAIT_POLICY=passive
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo test
cargo build --bin superfluid
python3 -m pip install --quiet ./clients/python
SUPERFLUID_BIN="$CARGO_TARGET_DIR/debug/superfluid" python3 -m pytest -q clients/python/tests
