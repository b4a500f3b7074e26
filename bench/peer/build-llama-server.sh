#!/usr/bin/env bash
# Build (or reuse) llama.cpp's llama-server, the benchmark peer, and print its
# path last. See scripts/build-llama-tool.sh for the source, cache and options.
set -euo pipefail
exec "$(dirname "$0")/../../scripts/build-llama-tool.sh" llama-server
