# Sourced by the scripts: one build directory and one compiler cache outside
# the clone, so llama.cpp (about 15 minutes on 2 cores) is built once per machine.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/superfluid/target}"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/superfluid/ccache}"
# llama-cpp-sys-2 builds llama.cpp for portable AVX2 unless Rust itself is
# built for the native CPU. Where this CPU has AVX-512 (with VNNI), turn on
# ggml's AVX-512 kernels by its own GGML_* options instead, which rebuilds
# only llama.cpp, not every Rust crate. Decided per machine, like the cache.
if [ -z "${SUPERFLUID_PORTABLE:-}" ] && grep -qw avx512f /proc/cpuinfo 2>/dev/null \
   && grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null; then
  export GGML_AVX512=ON GGML_AVX512_VNNI=ON
  grep -qw avx512vbmi /proc/cpuinfo && export GGML_AVX512_VBMI=ON
  grep -qw avx512_bf16 /proc/cpuinfo && export GGML_AVX512_BF16=ON
fi
