#!/usr/bin/env bash
# Set up a fresh machine for superfluid: the system packages llama.cpp's build
# needs, and the default model. Idempotent; prints the model's path last.
set -euo pipefail
need=()
for cmd in cmake clang ccache; do command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd"); done
# bindgen needs libclang itself, not just the clang driver.
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing cmake clang libclang-dev ccache" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq cmake clang libclang-dev ccache >&2
fi
# Headless Chromium for tests/tests/browser.rs (the spec's browser snippet).
if [ ! -x /usr/bin/chromium ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing chromium" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >&2
fi
# promtool (Debian's prometheus package) for tests/tests/metrics.rs: `promtool check metrics`.
if ! command -v promtool >/dev/null; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing prometheus (promtool)" >&2
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >&2
fi
model=$("$(dirname "$0")/fetch-model.sh")
# Test models derived from the default one by rewriting GGUF metadata (tools + thinking template,
# FIM token ids): see make-test-models.py. Their paths go to stderr; the last line stays the model's.
python3 -c "import gguf" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check gguf >&2
python3 "$(dirname "$0")/make-test-models.py" "$model" >&2
# The Python client's tests (clients/python/tests) run under pytest, and the
# compatible routes' tests drive the daemon with the official SDKs.
python3 -c "import pytest" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check pytest >&2
# The page's tests (clients/python/tests/test_page.py) drive the system
# Chromium with Playwright; no `playwright install`: it uses /usr/bin/chromium.
python3 -c "import playwright" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check playwright >&2
python3 -c "import openai, anthropic, ollama, sys; sys.exit(int(openai.__version__.split('.')[0]) < 3 or int(anthropic.__version__.split('.')[0]) < 2)" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check "openai>=3,<4" "anthropic>=2,<3" "ollama>=0.6,<1" >&2
# The Responses route's agent test (clients/python/tests/test_agents_sdk.py) runs the OpenAI Agents SDK.
python3 -c "import agents" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check "openai-agents>=0.24,<1" >&2
# The OTLP export's test (clients/python/tests/test_export_otlp.py) parses each pushed body with the
# official OTLP schema: opentelemetry-proto's messages through protobuf's JSON parser.
python3 -c "import opentelemetry.proto.collector.trace.v1.trace_service_pb2, google.protobuf.json_format" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check opentelemetry-proto protobuf >&2
echo "$model"
