#!/usr/bin/env bash
# Set up, build SmolLM2-135M-Instruct (bf16) into out/smollm2-bf16, serve it with the real
# tritonserver, stream one answer over tritonclient gRPC, and stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"Once upon a time, in a small village by the sea,"}
.venv/bin/build-engine --config configs/smollm2-bf16.yaml --output out/smollm2-bf16
.venv/bin/kiln serve out/smollm2-bf16/triton_repo --grpc-port 8001 --http-port 8000 --metrics-port 8002 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for _ in $(seq 1 120); do
  curl -sf localhost:8000/v2/health/ready >/dev/null && break
  kill -0 $server 2>/dev/null || { echo "kiln serve exited" >&2; exit 1; }
  sleep 1
done
echo "prompt: $PROMPT"
.venv/bin/kiln generate --url localhost:8001 --max-tokens 64 "$PROMPT"
