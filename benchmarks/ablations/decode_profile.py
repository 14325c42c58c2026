"""Where a one-thread decode step's time goes: torch.profiler over 20 steps at ~190 cached
tokens (after a 128-token prefill), ops sorted by their own time. The profiler adds a few
microseconds to every op, so small ops read high; the step time above the table has no profiler.
--python-loop profiles the model's Python layer loop instead of kiln::decode_layers (each kernel
call its own row); --threads N runs on N threads (default 1).

    PYTHONPATH=. python benchmarks/ablations/decode_profile.py out/smollm2-int8-wo/engine [--python-loop] [--threads 2]"""
import statistics
import sys

import torch
from torch.profiler import profile

from decode_steps import step_timer
from kiln.runtime.engine import Engine

threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
torch.set_num_threads(threads)
engine = Engine(sys.argv[1])
engine.model.fused_decode = "--python-loop" not in sys.argv
run = step_timer(engine, 128)
print(f"step {statistics.median(run() for _ in range(5)):.2f} ms")
with profile() as prof:
    run(20)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
