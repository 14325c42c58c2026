"""Where a one-thread decode step's time goes: torch.profiler over 20 steps at ~190 cached
tokens (after a 128-token prefill), ops sorted by their own time. The profiler adds a few
microseconds to every op, so small ops read high; the step time above the table has no profiler.

    PYTHONPATH=. python benchmarks/ablations/decode_profile.py out/smollm2-int8-wo/engine"""
import statistics
import sys
import time

import torch
from torch.profiler import profile

from kiln.runtime.engine import Engine
from kiln.runtime.model import KVPool, StepContext

torch.set_num_threads(1)
engine = Engine(sys.argv[1])
model, block = engine.model, engine.limits.kv_block_size
prompt = list(range(100, 228))
table = list(range(-(-(len(prompt) + 80) // block)))
pool = KVPool(engine.spec, len(table), block, model.kv_dtype)
model.forward(torch.tensor(prompt), StepContext.single(0, len(prompt), table), pool)
steps = [StepContext.single(len(prompt) + i, 1, table) for i in range(64)]


def run(n=64):
    start = time.perf_counter()
    for i in range(n):
        model.forward(torch.tensor([5]), steps[i], pool)
    return (time.perf_counter() - start) / n * 1000


run(8)
print(f"step {statistics.median(run() for _ in range(5)):.2f} ms")
with profile() as prof:
    run(20)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
