#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
# Without arguments, on a host with AVX-512 the engine-level tests (runtime, e2e, quantize,
# builder) run a second time with KILN_ISA=avx2, so that the AVX2 kernels serve whole models
# too (the kernel tests in tests/plugins already run every instruction set the host has).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export KILN_REQUIRE_MODELOPT=${KILN_REQUIRE_MODELOPT:-1}  # the Model Optimizer tests run, never skip
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
if grep -qw avx512f /proc/cpuinfo; then
  echo "--- the engine-level tests again on the AVX2 kernels (KILN_ISA=avx2)"
  KILN_ISA=avx2 .venv/bin/python -m pytest -q tests/runtime tests/e2e tests/quantize tests/builder
fi
