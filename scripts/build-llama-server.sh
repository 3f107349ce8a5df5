#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (that target only) from the source
# llama-cpp-python 0.3.36 vendors, so `specd bench --llama-server` compares
# specd with the C++ server built from the same llama.cpp specd runs on.
# About 7 minutes on 2 cores; cached afterwards. Prints the binary's path.
#   scripts/build-llama-server.sh            # build once, print the path
#   LLAMA_SERVER_FORCE=1 scripts/build-llama-server.sh   # rebuild
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SPECD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specd}"
ROOT="$CACHE/llama-server-$VERSION"
BIN="$ROOT/build/bin/llama-server"
if [ -x "$BIN" ] && [ -z "${LLAMA_SERVER_FORCE:-}" ]; then
  echo "$BIN"
  exit 0
fi
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$ROOT/sdist" "llama-cpp-python==$VERSION" >&2
  rm -rf "$ROOT/unpack" && mkdir -p "$ROOT/unpack"
  tar -xzf "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT/unpack"
  mv "$ROOT/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/unpack"
fi
# Native CPU code as a user building on this machine gets it; no curl (models
# are local files), no tests or examples: only the server target is built.
# No AMX, as specd's own build (scripts/setup.sh says why).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$ROOT/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
