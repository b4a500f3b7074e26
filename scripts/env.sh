# Sourced by the scripts: one build directory and one compiler cache outside
# the clone, so llama.cpp (about 15 minutes on 2 cores) is built once per machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/superfluid/target}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/superfluid/ccache}"

# superfluid's change to llama.cpp's CPU attention (ggml-patch/), included by
# CMake when llama-cpp-sys-2 configures llama.cpp. CMake keeps the path it
# was configured with and reads it again on a later reconfigure, so it is
# given a copy that outlives this clone (CI clones come and go).
sf_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sf_patch="$HOME/.cache/superfluid/ggml-patch"
mkdir -p "$sf_patch"
for f in superfluid.cmake fa-tiled.cpp; do
  cmp -s "$sf_root/ggml-patch/$f" "$sf_patch/$f" || cp "$sf_root/ggml-patch/$f" "$sf_patch/$f"
done
export CMAKE_PROJECT_INCLUDE="$sf_patch/superfluid.cmake"
# llama-cpp-sys-2 configures CMake only when its build has no CMakeCache.txt:
# a llama.cpp configured before ggml-patch existed is configured again (the
# cache and the crate's fingerprints removed, so cargo runs its build script
# and bundles the libraries again; the objects are kept, so CMake compiles
# only what changed).
for cache in "$CARGO_TARGET_DIR"/*/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt; do
  [ -f "$cache" ] || continue
  grep -q "^CMAKE_PROJECT_INCLUDE:.*superfluid.cmake" "$cache" && continue
  run_dir="${cache%/out/build/CMakeCache.txt}"
  profile_dir="${run_dir%/build/*}"
  echo "env: llama.cpp in $run_dir is configured again, with ggml-patch" >&2
  rm -f "$cache"
  rm -rf "$profile_dir"/.fingerprint/llama-cpp-sys-2-*
done
unset sf_root sf_patch cache run_dir profile_dir
