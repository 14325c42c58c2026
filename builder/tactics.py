"""Tactics, as TensorRT has them: at build-engine, every distinct linear of the engine (by
runtime/linear.py's tactic_key: implementation, dtype, shape, group) is timed on this host at each
row-count bucket, every implementation it has (kiln's kernel on the packed weights; the weights
dequantized, then PyTorch's GEMM), and the fastest is recorded in engine.json for the runtime to
use (LlamaModel.apply_tactics).

    fast        buckets 1, 2, 4, ... up to max_num_tokens (the output projection: max_batch_size,
                the most rows it sees while serving); the median of 3 calls; once PyTorch's GEMM
                has won two buckets running, the larger ones take it untimed (a GEMM gains on a
                GEMV as the rows grow)
    exhaustive  every bucket timed, the median of 9 calls
    none        no tactics: each linear kind's default route

The same step times how far ahead the GEMVs prefetch their weights in software (kernels/vec.h):
one-token decode steps of the engine's own model at each distance in PREFETCH_BYTES, taking
turns, the fastest median recorded (the library's default on a tie). The gain differs by host: on
Intel Xeons measured 4 KB ahead decodes 1.13-1.67x faster than none, on an AMD EPYC (Zen 4) none
is as fast or faster (docs/benchmarks.md).

Each timing is kept in a cache (~/.cache/kiln/tactics.json, or KILN_TACTICS_CACHE) keyed by the
CPU model, the kernel level, the thread count, PyTorch's version and the plugin library's hash,
so a rebuild on the same host times nothing it has timed before."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from kiln import constants as names
from kiln.plugins import ops
from kiln.plugins.host import cpu_model

REPEATS = {"fast": 3, "exhaustive": 9}
SEED = 0  # the inputs' generator (the timings do not depend on the values)
PREFETCH_BYTES = (0, 4096)  # the software prefetch distances timed; 4096: the library's default
DEFAULT_PREFETCH_BYTES = 4096  # (csrc/library.cpp, without KILN_PREFETCH_BYTES): chosen on a tie
PREFETCH_STEPS = {"fast": 7, "exhaustive": 21}  # decode steps timed at each distance
PREFETCH_CONTEXT = 16  # tokens already cached in those steps


def cache_path() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln" / "tactics.json"
    return Path(os.environ.get("KILN_TACTICS_CACHE", default))


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... below max_rows, then max_rows."""
    found, rows = [], 1
    while rows < max_rows:
        found.append(rows)
        rows *= 2
    return found + [max_rows]


def median_us(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median microseconds of `repeats` timed calls after `warmup` untimed ones (first-touch pages,
    the GEMM's packing buffers); benchmarks/ablations time with it too."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


class TimingCache:
    """(host, tactic_key, rows, implementation) -> (median µs, calls timed), in a JSON file."""

    def __init__(self, path: Path, host: str):
        self.path, self.host = path, host
        try:
            self.entries = json.loads(path.read_text())
            if not isinstance(self.entries, dict):
                raise ValueError("not an object")
        except (OSError, ValueError):  # absent, or not ours: start afresh (it is only a cache)
            self.entries = {}

    def get(self, key: str, rows: int, choice: str, repeats: int) -> float | None:
        entry = self.entries.get(f"{self.host}|{key}|{rows}|{choice}")
        return entry[0] if entry and entry[1] >= repeats else None

    def put(self, key: str, rows: int, choice: str, us: float, repeats: int) -> None:
        self.entries[f"{self.host}|{key}|{rows}|{choice}"] = [us, repeats]

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staged = self.path.with_suffix(f".{os.getpid()}.tmp")
            staged.write_text(json.dumps(self.entries))
            staged.replace(self.path)
        except OSError:
            pass  # a read-only home: the next build times again


def choose(model, mode: str, max_num_tokens: int, max_batch_size: int, library: Path,
           progress: Callable[[], None] = lambda: None) -> dict:
    """engine.json's tactics section for `model` (runtime LlamaModel of the engine's weights).
    progress() is called once per distinct linear."""
    repeats = REPEATS[mode]
    isa, threads = ops.active_isa(), torch.get_num_threads()
    host = "|".join([cpu_model(), isa, f"threads={threads}", torch.__version__, library.parent.name])
    cache = TimingCache(cache_path(), host)
    generator = torch.Generator().manual_seed(SEED)
    linears = {}
    head = model.lm_head
    for linear in model.linears():
        key = linear.tactic_key()
        if key in linears or len(linear.candidates()) < 2:  # one route: nothing to choose
            continue
        in_features = linear.features[0]
        rows_wanted = buckets(max_batch_size if linear is head else max_num_tokens)
        x = torch.randn(rows_wanted[-1], in_features, generator=generator).to(model.dtype)
        linears[key] = time_linear(linear, key, x, rows_wanted, mode, repeats, cache)
        progress()
    cache.save()
    return {"mode": mode, "isa": isa, "cpu": cpu_model(), "threads": threads, "linears": linears,
            names.TACTIC_PREFETCH: choose_prefetch(model, mode)}


def seconds(run: Callable[[], object]) -> float:
    """How long one call of run() took."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def choose_prefetch(model, mode: str) -> dict:
    """How far ahead of their reads the decode GEMVs prefetch their weights on this host: the
    median of one-token decode steps (every weight read once; from memory where the weights
    outgrow the caches) at each distance, the distances taking turns after a round that warms up.
    {"bytes": the fastest, "step_us": {distance: median µs}}; the linears take their tactics
    after this, so the steps run each linear's default route."""
    from kiln.runtime.model import KVPool, StepContext

    block_size = 16
    blocks = -(-(PREFETCH_CONTEXT + 1) // block_size)
    table = list(range(blocks))
    pool = KVPool(model.spec, blocks, block_size, model.kv_dtype)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(model.spec.vocab_size, (PREFETCH_CONTEXT + 1,), generator=generator)
    step = StepContext.single(PREFETCH_CONTEXT, 1, table)
    times: dict[int, list[float]] = {nbytes: [] for nbytes in PREFETCH_BYTES}
    before = ops.set_prefetch(DEFAULT_PREFETCH_BYTES)
    try:
        model.forward(tokens[:-1], StepContext.single(0, PREFETCH_CONTEXT, table), pool)
        for round_ in range(PREFETCH_STEPS[mode] + 1):
            for nbytes in PREFETCH_BYTES:
                ops.set_prefetch(nbytes)
                taken = seconds(lambda: model.forward(tokens[-1:], step, pool))
                if round_:
                    times[nbytes].append(taken)
    finally:
        ops.set_prefetch(before)
    step_us = {nbytes: round(1e6 * statistics.median(taken), 1) for nbytes, taken in times.items()}
    best = min(step_us, key=lambda nbytes: (step_us[nbytes], nbytes != DEFAULT_PREFETCH_BYTES))
    return {"bytes": best, "step_us": {str(nbytes): us for nbytes, us in step_us.items()}}


def time_linear(linear, key: str, x: torch.Tensor, rows_wanted: list[int], mode: str, repeats: int,
                cache: TimingCache) -> dict:
    """One linear's tactic: per bucket the fastest of its candidates and the times measured (None
    where not timed)."""
    timed = {choice: [] for choice in linear.candidates()}
    choices, torch_streak = [], 0
    for rows in rows_wanted:
        times = {}
        for choice in timed:
            if mode == "fast" and torch_streak >= 2:
                break
            us = cache.get(key, rows, choice, repeats)
            if us is None:
                us = median_us(lambda: linear.run(x[:rows], choice), repeats)
                cache.put(key, rows, choice, us, repeats)
            times[choice] = us
        recorded = {choice: round(us, 1) for choice, us in times.items()}  # engine.json's 0.1 µs
        for choice in timed:
            timed[choice].append(recorded.get(choice))
        # the faster as recorded, kiln's kernel on a tie (its rows are batch invariant), so the times
        # in engine.json always show why each choice was made; untimed: the GEMM's streak
        best = (min(recorded, key=lambda choice: (recorded[choice], choice != names.TACTIC_KILN)) if recorded
                else names.TACTIC_TORCH)
        torch_streak = torch_streak + 1 if best == names.TACTIC_TORCH else 0
        choices.append(best)
    return {"buckets": rows_wanted, "choices": choices, "kiln_us": timed[names.TACTIC_KILN],
            "torch_us": timed[names.TACTIC_TORCH]}
