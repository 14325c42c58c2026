#!/usr/bin/env bash
# The OpenVINO GenAI peer's own environment (.venv-openvino): optimum-intel pins a transformers
# of its own, so it does not share kiln's. Used by benchmarks/peers/run.py --openvino.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
[ -x .venv-openvino/bin/python ] || "$PYTHON" -m venv .venv-openvino
.venv-openvino/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0" "numpy<2" \
  "openvino==2026.4.1" "openvino-genai==2026.4.1.0" "openvino-tokenizers==2026.4.1.0" \
  "optimum-intel[openvino]==2.2.0" "nncf==3.4.0" gguf accelerate
# optimum pulls a torchvision built for another torch, which breaks importing transformers' models
.venv-openvino/bin/python -m pip uninstall -y -q torchvision || true
echo "OpenVINO GenAI peer installed in $(pwd)/.venv-openvino" >&2
