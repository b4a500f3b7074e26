# Sourced by the scripts, from the repository's root (POSIX sh or bash): one
# build directory and one compiler cache outside
# the clone, so llama.cpp (about 15 minutes on 2 cores) is built once per machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/superfluid/target}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/superfluid/ccache}"

# superfluid's change to llama.cpp's CPU attention (ggml-patch/), included by
# CMake when llama-cpp-sys-2 configures llama.cpp. CMake keeps the path it
# was configured with and reads it again on a later reconfigure, so it is
# given a copy that outlives this clone (CI clones come and go). Without
# ggml-patch/ here (sourced from elsewhere) .cargo/config.toml's path stands.
sf_root="$(pwd)"
sf_patch="$HOME/.cache/superfluid/ggml-patch"
if [ -f "$sf_root/ggml-patch/superfluid.cmake" ] && [ -f "$sf_root/ggml-patch/fa-tiled.cpp" ]; then
  mkdir -p "$sf_patch"
  for f in superfluid.cmake fa-tiled.cpp; do
    cmp -s "$sf_root/ggml-patch/$f" "$sf_patch/$f" || cp "$sf_root/ggml-patch/$f" "$sf_patch/$f"
  done
  export CMAKE_PROJECT_INCLUDE="$sf_patch/superfluid.cmake"
else
  echo "env: no ggml-patch/ in $sf_root: source scripts/env.sh from the repository's root" >&2
fi
# llama-cpp-sys-2 configures CMake only when its build has no CMakeCache.txt:
# a llama.cpp configured before ggml-patch existed is configured again (the
# cache and the crate's fingerprints removed, so cargo runs its build script
# and bundles the libraries again; the objects are kept, so CMake compiles
# only what changed).
# Both the scripts' build directory and a plain `cargo build`'s target/.
for cache in "$CARGO_TARGET_DIR"/*/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt \
             "$sf_root"/target/*/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt; do
  [ -f "$cache" ] || continue
  grep -q "^CMAKE_PROJECT_INCLUDE:.*superfluid.cmake" "$cache" && continue
  run_dir="${cache%/out/build/CMakeCache.txt}"
  profile_dir="${run_dir%/build/*}"
  echo "env: llama.cpp in $run_dir is configured again, with ggml-patch" >&2
  rm -f "$cache"
  rm -rf "$profile_dir"/.fingerprint/llama-cpp-sys-2-*
done
unset sf_root sf_patch cache run_dir profile_dir
