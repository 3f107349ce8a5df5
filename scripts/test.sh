#!/usr/bin/env bash
# Install everything (the project's .venv, the deploy-check tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash .ci/install-deploy-tools
# a real Prometheus server for tests/test_prometheus.py (Debian's package)
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# Node.js: the public API's Node client test and buf (tests/node/package.json)
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
(cd tests/node && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
exec .venv/bin/python -m pytest -q --durations=25 "$@"
