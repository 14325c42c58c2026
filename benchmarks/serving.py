"""Serving benchmark: output tokens/s, TTFT and inter-token latency (P50/P99) at several
concurrency levels, in process (the Executor through LLM.stream) and through a real
tritonserver over tritonclient gRPC streaming; plus KV memory per token, paging waste, and where
the cores went (each process's CPU time over the level's wall time). `kiln bench` is the general
tool; this script adds the in-process side and the process split.

    python benchmarks/serving.py --engine out/smollm2-bf16/engine \
        --repo out/smollm2-bf16/triton_repo --threads 2 --json out/serving.json

Every request has the same prompt length and a fixed output length (no early stop). Prints a
table of medians/percentiles and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kiln.bench import NEVER, percentile, runtime_options, synthetic_prompts

class Recorder:
    """TTFT is kept apart for the first wave (every worker's first request, all sent at once)
    and for the steady state after it (a new request joins streams already decoding)."""

    def __init__(self, concurrency: int):
        self.lock = threading.Lock()
        self.concurrency = concurrency
        self.submitted = 0
        self.ttft: list[float] = []
        self.ttft_steady: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0

    def add(self, submitted: float, arrivals: list[tuple[float, int]]) -> None:
        with self.lock:
            if arrivals:
                self.ttft.append(arrivals[0][0] - submitted)
                if self.submitted >= self.concurrency:
                    self.ttft_steady.append(arrivals[0][0] - submitted)
            self.submitted += 1
            for (a, _), (b, _) in zip(arrivals, arrivals[1:]):
                self.itl.append(b - a)
            self.tokens += sum(n for _, n in arrivals)


def in_process(llm, prompt: str, max_tokens: int) -> tuple[float, list[tuple[float, int]]]:
    submitted = time.perf_counter()
    arrivals = []
    for chunk in llm.stream(prompt, max_tokens=max_tokens, end_id=NEVER):
        if chunk.token_ids:
            arrivals.append((time.perf_counter(), len(chunk.token_ids)))
    return submitted, arrivals


def over_grpc(url: str, tokenizer, prompt: str, max_tokens: int) -> tuple[float, list[tuple[float, int]]]:
    from kiln.triton_repo.client import stream_generate

    submitted = time.perf_counter()
    arrivals = []
    for text in stream_generate(url, prompt, max_tokens, end_id=NEVER):
        # a chunk carries whole characters; count its tokens once the stream is done
        arrivals.append((time.perf_counter(), text))
    texts = [t for _, t in arrivals]
    total = max_tokens
    per_chunk = [max(1, len(tokenizer.encode(t, add_special_tokens=False).ids)) for t in texts]
    scale = total / max(sum(per_chunk), 1)
    return submitted, [(t, n * scale) for (t, _), n in zip(arrivals, per_chunk)]


def cpu_used(server=None) -> dict[str, float]:
    """CPU seconds used so far: this process (the client, and in process the engine too) and, with
    a server, tritonserver and each model's backend stub."""
    return {"client": time.process_time(), **(server.cpu_seconds() if server else {})}


def run_level(call, prompts: list[str], concurrency: int, max_tokens: int, sampler=None, server=None) -> dict:
    """One concurrency level's figures; `cores` is each process's CPU time over the level's wall
    time (1.0: one core busy all along), so the split of the machine between the engine, Triton's
    processes and the client shows."""
    recorder = Recorder(concurrency)
    queue = list(prompts)
    lock = threading.Lock()
    samples = []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            recorder.add(*call(prompt, max_tokens))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    cpu_before = cpu_used(server)
    start = time.perf_counter()
    for t in threads:
        t.start()
    if sampler:
        while any(t.is_alive() for t in threads):
            samples.append(sampler())
            time.sleep(0.2)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu_after = cpu_used(server)
    row = {
        "concurrency": concurrency, "requests": len(prompts), "output_tokens": round(recorder.tokens),
        "wall_s": wall, "tokens_per_s": recorder.tokens / wall,
        "ttft_p50_ms": 1000 * percentile(recorder.ttft, 50), "ttft_p99_ms": 1000 * percentile(recorder.ttft, 99),
        "ttft_steady_p50_ms": 1000 * percentile(recorder.ttft_steady, 50),
        "ttft_steady_p99_ms": 1000 * percentile(recorder.ttft_steady, 99),
        "itl_p50_ms": 1000 * percentile(recorder.itl, 50), "itl_p99_ms": 1000 * percentile(recorder.itl, 99),
        "cores": {name: (cpu_after[name] - cpu_before[name]) / wall for name in cpu_after if name in cpu_before},
    }
    if samples:
        busy = [s for s in samples if s["blocks_used"]]
        if busy:
            waste = [1 - s["tokens_cached"] / (s["blocks_used"] * s["block_size"]) for s in busy]
            row["paging_waste_median"] = statistics.median(waste)
            row["blocks_used_max"] = max(s["blocks_used"] for s in busy)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, help="engine dir (in-process runs, tokenizer)")
    parser.add_argument("--repo", default=None, help="Triton repository to serve and measure over gRPC")
    parser.add_argument("--url", default=None, help="an already running server's gRPC HOST:PORT")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-level", type=int, default=3, help="requests = this x concurrency (min 4)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runtime", nargs="*", default=[], metavar="KEY=VALUE",
                        help="run-time options over the engine's, as JSON values (max_prefill_share=0.25)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's stub inherits it
    import torch

    torch.set_num_threads(args.threads)
    from kiln.runtime.llm import LLM

    runtime = runtime_options(args.runtime)
    llm = LLM(args.engine, **runtime)
    tokenizer = llm.tokenizer
    block_size = llm.limits.kv_block_size
    spec = llm.engine.spec
    element = torch.empty(0, dtype=llm.engine.dtype).element_size()
    formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element

    def sampler():
        stats = llm.stats()
        return {**stats, "block_size": block_size}

    rows = []
    console = Console(stderr=True)
    for level in args.concurrency:
        prompts = synthetic_prompts(tokenizer, max(4, args.requests_per_level * level), args.prompt_tokens, level)
        console.print(f"in-process, concurrency {level} ...")
        rows.append({"path": "in-process", **run_level(lambda p, n: in_process(llm, p, n), prompts, level,
                                                         args.output_tokens, sampler)})
    llm.close()
    del llm
    server = None
    url = args.url
    if args.repo and not url:
        from kiln.triton_repo.serve import TritonServer

        server = TritonServer(args.repo, runtime=runtime).start()
        url = server.grpc_url
    try:
        if url:
            for level in args.concurrency:
                prompts = synthetic_prompts(tokenizer, max(4, args.requests_per_level * level), args.prompt_tokens, level)
                console.print(f"tritonserver gRPC, concurrency {level} ...")
                rows.append({"path": "gRPC", **run_level(lambda p, n: over_grpc(url, tokenizer, p, n), prompts,
                                                           level, args.output_tokens, server=server)})
    finally:
        if server:
            server.stop()

    for path in ("in-process", "gRPC"):
        base = next((r for r in rows if r["path"] == path and r["concurrency"] == 1), None)
        for r in rows:
            if base and r["path"] == path:
                r["throughput_vs_c1"] = r["tokens_per_s"] / base["tokens_per_s"]
                r["ttft_p99_vs_c1"] = r["ttft_p99_ms"] / base["ttft_p99_ms"]

    table = Table(title=f"serving: prompt {args.prompt_tokens} tokens, output {args.output_tokens} tokens, "
                        f"{args.threads} threads")
    for column in ("path", "conc.", "requests", "tok/s", "x c=1", "TTFT p50", "TTFT p99", "p99 x c=1",
                   "steady TTFT p50", "steady TTFT p99", "ITL p50", "ITL p99", "paging waste"):
        table.add_column(column, justify="right")
    for r in rows:
        waste = r.get("paging_waste_median")
        table.add_row(r["path"], str(r["concurrency"]), str(r["requests"]), f"{r['tokens_per_s']:.1f}",
                      f"{r.get('throughput_vs_c1', 0):.2f}", f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}",
                      f"{r.get('ttft_p99_vs_c1', 0):.2f}", f"{r['ttft_steady_p50_ms']:.0f}",
                      f"{r['ttft_steady_p99_ms']:.0f}", f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                      f"{100 * waste:.1f}%" if waste is not None else "-")
    Console(width=200).print(table)
    Console().print("latencies in ms")
    cores = Table(title=f"where the cores went: CPU time / wall time, each process ({os.cpu_count()} CPUs)")
    names_seen = list(dict.fromkeys(name for r in rows for name in r["cores"]))
    for column in ("path", "conc.", *names_seen, "all"):
        cores.add_column(column, justify="right")
    for r in rows:
        cores.add_row(r["path"], str(r["concurrency"]),
                      *(f"{r['cores'][n]:.2f}" if n in r["cores"] else "-" for n in names_seen),
                      f"{sum(r['cores'].values()):.2f}")
    Console(width=200).print(cores)
    Console().print("client: this process (in process, the engine runs in it too); the other columns: "
                    "tritonserver and each model's backend stub")
    Console().print(f"KV bytes per token: formula 2 x layers x kv_heads x head_dim x bytes = {formula}; "
                    f"pool: {formula} (block_size {block_size})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "load_avg": os.getloadavg(), "torch": torch.__version__, "kv_bytes_per_token_formula": formula,
                "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
