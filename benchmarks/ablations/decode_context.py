"""One-thread decode step time of an engine at 8, 128 and 1,000 cached tokens (64 steps after a
prefill, median of 5): what attention adds as the context grows.

    PYTHONPATH=. python benchmarks/ablations/decode_context.py out/smollm2-int8-wo/engine"""
import statistics
import sys

import torch

from decode_steps import step_timer
from kiln.runtime.engine import Engine

torch.set_num_threads(1)
engine = Engine(sys.argv[1])
for cached in (8, 128, 1000):
    run = step_timer(engine, cached)
    print(f"{cached:5d} cached tokens: {statistics.median(run() for _ in range(5)):.2f} ms a step", flush=True)
