#!/usr/bin/env bash
# Create .venv in the repo root and install specd with its dev extras.
# llama-cpp-python builds from source on first install (about 9 minutes on
# 2 cores; pip caches the wheel afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Built for this machine's CPU (-march=native) but without AMX: some VMs
# report AMX in CPUID without enabling its register state, and llama.cpp's
# AMX kernels then die with SIGILL on the first batch (its runtime check
# passes there). AMX only speeds up quantised batches on Xeons that have it.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# llama-cpp-python builds llama.cpp as shared libraries, compiled -fPIC: GCC
# then may not inline or call directly any exported function (another
# library could interpose it), and every call between its files goes through
# the PLT. That made a token 9-12% slower than llama.cpp's own static build
# (docs/perf/README.md); these two flags give the static build's speed back.
# -frecord-gcc-switches leaves the flags in the library, so a wheel built
# without them (pip's cache keys a wheel by version, not by CMAKE_ARGS) is
# found below and rebuilt.
FAST="-fno-semantic-interposition -fno-plt -frecord-gcc-switches"
FLAGS="$NO_AMX $FAST"
DEFAULT_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$FLAGS' -DCMAKE_CXX_FLAGS='$FLAGS'"
CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}" .venv/bin/python -m pip install -q -e ".[dev,bench]"
if [ -z "${CMAKE_ARGS:-}" ] && ! .venv/bin/python scripts/llama_build_flags.py --has -fno-semantic-interposition; then
  echo "llama-cpp-python was built without $FAST (a cached wheel): rebuilding it (minutes)" >&2
  CMAKE_ARGS="$DEFAULT_CMAKE_ARGS" .venv/bin/python -m pip install -q --force-reinstall --no-deps \
    --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$(.venv/bin/python scripts/llama_build_flags.py --version)"
fi
