#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the checks CI runs:
# ruff (lint and format), mypy over the packages and benchmarks/, and pytest (all markers; gpu tests
# skip themselves where no CUDA device is visible). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy" trainer gateway rollout_engine mappings transport benchmarks
"$VENV/bin/python" -m pytest "$@"
