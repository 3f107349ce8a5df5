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
DEFAULT_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
CMAKE_ARGS="${CMAKE_ARGS:-$DEFAULT_CMAKE_ARGS}" .venv/bin/python -m pip install -q -e ".[dev,bench]"
