#!/usr/bin/env bash
# Install everything (the project's .venv, the deploy-check tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash .ci/install-deploy-tools
exec .venv/bin/python -m pytest -q "$@"
