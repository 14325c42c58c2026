"""One-token decode steps of an engine's model, timed: the shared part of the decode ablations."""
import time

import torch

from kiln.runtime.model import KVPool, StepContext


def step_timer(engine, cached: int, steps: int = 64):
    """Prefill `cached` prompt tokens into a pool of their own, then run(n) -> milliseconds per
    one-token step over the next n (<= steps) positions (the same positions every call)."""
    model, block = engine.model, engine.limits.kv_block_size
    table = list(range(-(-(cached + steps + 16) // block)))
    pool = KVPool(engine.spec, len(table), block, model.kv_dtype)
    model.forward(torch.tensor(list(range(100, 100 + cached))), StepContext.single(0, cached, table), pool)
    contexts = [StepContext.single(cached + i, 1, table) for i in range(steps)]

    def run(n: int = steps) -> float:
        start = time.perf_counter()
        for i in range(n):
            model.forward(torch.tensor([5]), contexts[i], pool)
        return (time.perf_counter() - start) / n * 1000

    run(8)  # warm up
    return run
