"""One-thread decode step time of an engine at 8, 128 and 1,000 cached tokens (64 steps after a
prefill, median of 5): what attention adds as the context grows.

    PYTHONPATH=. python benchmarks/ablations/decode_context.py out/smollm2-int8-wo/engine"""
import statistics
import sys
import time

import torch

from kiln.runtime.engine import Engine
from kiln.runtime.model import KVPool, StepContext

torch.set_num_threads(1)
engine = Engine(sys.argv[1])
model, block = engine.model, engine.limits.kv_block_size
for cached in (8, 128, 1000):
    prompt = list(range(100, 100 + cached))
    table = list(range(-(-(cached + 80) // block)))
    pool = KVPool(engine.spec, len(table), block, model.kv_dtype)
    model.forward(torch.tensor(prompt), StepContext.single(0, cached, table), pool)
    steps = [StepContext.single(cached + i, 1, table) for i in range(64)]

    def run(n=64):
        start = time.perf_counter()
        for i in range(n):
            model.forward(torch.tensor([5]), steps[i], pool)
        return (time.perf_counter() - start) / n * 1000

    run(8)
    print(f"{cached:5d} cached tokens: {statistics.median(run() for _ in range(5)):.2f} ms a step", flush=True)
