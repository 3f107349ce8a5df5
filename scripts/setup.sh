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
CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" .venv/bin/python -m pip install -q -e ".[dev,bench]"
