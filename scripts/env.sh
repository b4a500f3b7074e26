# Sourced by the scripts: one build directory and one compiler cache outside
# the clone, so llama.cpp (about 15 minutes on 2 cores) is built once per machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/superfluid/target}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/superfluid/ccache}"
