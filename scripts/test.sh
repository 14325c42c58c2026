#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export KILN_REQUIRE_MODELOPT=${KILN_REQUIRE_MODELOPT:-1}  # the Model Optimizer tests run, never skip
exec .venv/bin/python -m pytest -q "$@"
