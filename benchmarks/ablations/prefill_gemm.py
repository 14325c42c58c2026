"""Prefill of bf16-activation engines through PyTorch's bf16 GEMM against kiln's float32 route
(runtime/linear.py gemm(): weights widened a block at a time, float32 GEMM, outputs rounded to
bf16), side by side in one process: the two routes take turns prompt by prompt. Also the build's
accuracy step's shape: a window with logits at every position (--all-logits).

    PYTHONPATH=. python benchmarks/ablations/prefill_gemm.py --engine out/smollm2-bf16/engine \
        --engine out/smollm2-int4-awq/engine --prompt-tokens 128 512 --threads 1 2 --json out/prefill.json

Prints medians and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_info  # noqa: E402

ROUTES = ("bf16", "float32")


@contextmanager
def forced_route(route: str):
    """runtime/linear.py's gemm() on one route ("bf16": PyTorch's bf16 GEMM) while inside."""
    from kiln.runtime import linear

    chosen = linear.native_bf16_gemm
    linear.native_bf16_gemm = lambda: route == "bf16"
    try:
        yield
    finally:
        linear.native_bf16_gemm = chosen


def time_engine(engine_dir: str, prompt_tokens: list[int], threads: list[int], repeats: int,
                all_logits: bool) -> list[dict]:
    from kiln.runtime.engine import Engine
    from kiln.runtime.model import KVPool, StepContext

    engine = Engine(engine_dir)
    model, block_size = engine.model, engine.limits.kv_block_size
    vocab = engine.spec.vocab_size
    ids = torch.randint(0, vocab, (max(prompt_tokens),), generator=torch.Generator().manual_seed(0))
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for n in prompt_tokens:
            blocks = -(-n // block_size)
            times = {route: [] for route in ROUTES}
            for r in range(repeats + 1):  # the first round warms up
                for route in ROUTES:
                    pool = KVPool(engine.spec, blocks, block_size, model.kv_dtype)
                    ctx = StepContext.single(0, n, list(range(blocks)), all_logits=all_logits)
                    with forced_route(route):
                        start = time.perf_counter()
                        model.forward(ids[:n], ctx, pool)
                    if r:
                        times[route].append(time.perf_counter() - start)
            ms = {route: 1000 * statistics.median(v) for route, v in times.items()}
            rows.append({"engine": engine_dir, "dtype": engine.meta["dtype"],
                         "algo": engine.meta.get("quantization", {}).get("algo", "none"), "threads": t,
                         "prompt_tokens": n, "all_logits": all_logits, "bf16_ms": ms["bf16"],
                         "float32_ms": ms["float32"], "speedup": ms["bf16"] / ms["float32"]})
            print(f"{rows[-1]['algo']:>9} {engine.meta['dtype']:>8} threads {t} prompt {n:>5}: "
                  f"bf16 GEMM {ms['bf16']:9.1f} ms, float32 route {ms['float32']:9.1f} ms, "
                  f"{rows[-1]['speedup']:.2f}x", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--all-logits", action="store_true", help="logits at every position (the accuracy report)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [row for engine in args.engine
            for row in time_engine(engine, args.prompt_tokens, args.threads, args.repeats, args.all_logits)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host_info(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
