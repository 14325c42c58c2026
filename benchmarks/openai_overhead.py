"""What the OpenAI frontend adds: the same prompt streamed through Triton gRPC (the ensemble,
tritonclient) and through the OpenAI endpoint (/v1/completions, server-sent events), one request
at a time, alternating, so both see the same machine; medians of time to first token and of the
whole request.

    python benchmarks/openai_overhead.py --grpc 127.0.0.1:8001 --openai http://127.0.0.1:9000/v1 \\
        --tokenizer out/smollm2/engine --json out/openai-overhead.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from kiln.bench import load_tokenizer, synthetic_prompts


def over_grpc(url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    from kiln.triton_repo.client import stream_responses

    start, first = time.perf_counter(), None
    for _ in stream_responses(url, prompt, max_tokens, end_id=-1):
        first = first or time.perf_counter() - start
    return first, time.perf_counter() - start


def over_openai(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    request = urllib.request.Request(f"{base_url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data:") and first is None:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", required=True, help="tritonserver gRPC HOST:PORT")
    parser.add_argument("--openai", required=True, help="the OpenAI endpoint's base URL (…/v1)")
    parser.add_argument("--model", default=None, help="the OpenAI model id (default: the one served)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="engine dir or tokenizer.json")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        with urllib.request.urlopen(f"{args.openai}/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]
    prompt = synthetic_prompts(load_tokenizer(args.tokenizer), 1, args.input_tokens)[0]
    times: dict[str, list[tuple[float, float]]] = {"triton gRPC (ensemble)": [], "OpenAI /v1/completions": []}
    for _ in range(args.rounds + 1):  # the first round warms both paths up and is not counted
        times["triton gRPC (ensemble)"].append(over_grpc(args.grpc, prompt, args.output_tokens))
        times["OpenAI /v1/completions"].append(over_openai(args.openai, model, prompt, args.output_tokens))
    rows = []
    print(f"{args.input_tokens}-token prompt, {args.output_tokens} tokens, {args.rounds} rounds, medians (ms)")
    print(f"{'path':<26}{'TTFT':>10}{'request':>10}")
    for path, samples in times.items():
        ttft = statistics.median(s[0] for s in samples[1:]) * 1000
        total = statistics.median(s[1] for s in samples[1:]) * 1000
        rows.append({"path": path, "ttft_ms_p50": ttft, "request_ms_p50": total})
        print(f"{path:<26}{ttft:>10.1f}{total:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps({"input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
                                         "rounds": args.rounds, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
