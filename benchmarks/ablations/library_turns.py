"""The side-by-side runs of the ablations that time ops on several builds of the plugin library
(one library a process): each round runs the calling script once per library, each in a process
of its own, in turn, so a noisy neighbour slows them alike."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time


def in_turns(script: str, libraries: list[str], rounds: int, args: list[str]) -> dict[str, list]:
    """library -> one result per round: the JSON the last line of `script --libraries ... --measure
    LIBRARY *args` prints."""
    runs: dict[str, list] = {lib: [] for lib in libraries}
    for _ in range(rounds):
        for lib in libraries:
            done = subprocess.run([sys.executable, script, "--libraries", *libraries, "--measure", lib, *args],
                                  check=True, capture_output=True, text=True)
            runs[lib].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def load(library: str, threads: int, seed: int):
    """This process on `library` and `threads` threads -> (ops, a torch.Generator seeded with `seed`)."""
    import torch
    from kiln.plugins import ops

    ops.load_library(library)
    torch.set_num_threads(threads)
    return ops, torch.Generator().manual_seed(seed)


def median_us(call, count: int, warmup: int) -> float:
    """Median microseconds of `count` timed calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)
