"""One-thread decode step time of one engine in several variants, interleaved in one process
(six rounds of 64 steps at ~190 cached tokens, median of each), so that the machine's drift hits
every variant alike:
- default: the layer loop as one plugin call (kiln::decode_layers) against the Python loop;
- --memory: where the weights sit, each weight loaded apart (Engine(..., weight_arena=False);
  benchmarks/ablations/weight_arena.py compares that with the default arena). The engine tiled,
  each weight in 2 MB pages of its own, and with int8 weights in the row layout: in 2 MB pages,
  in the pages safetensors gave them (the engine's copy into 2 MB pages skipped), and copied into
  ordinary anonymous memory (an int8 engine's question: its weights are the ones the runtime
  tiles or not).

    PYTHONPATH=. python benchmarks/ablations/decode_variants.py out/smollm2-int8-wo/engine [--memory]"""
import statistics
import sys

import torch
from decode_steps import step_timer

from kiln.plugins import ops
from kiln.runtime import engine as engine_module
from kiln.runtime.engine import Engine
from kiln.runtime.model import LINEARS

torch.set_num_threads(1)
path = sys.argv[1]


def load(tiled_int8: bool = True, hugepages: bool = True) -> Engine:
    """hugepages: each large weight in 2 MB pages of its own (weights in one arena: weight_arena.py)"""
    tiled, min_bytes = ops.tiled, engine_module.HUGEPAGE_MIN_BYTES
    ops.tiled = (lambda weight: tiled(weight) and weight != "int8") if not tiled_int8 else tiled
    engine_module.HUGEPAGE_MIN_BYTES = min_bytes if hugepages else float("inf")
    try:
        return Engine(path, weight_arena=False)
    finally:
        ops.tiled, engine_module.HUGEPAGE_MIN_BYTES = tiled, min_bytes


def cloned(engine: Engine) -> Engine:
    """Every quantized weight copied into ordinary (4 KB-page) anonymous memory."""
    model = engine.model
    for linear in [getattr(layer, name) for layer in model.layers for name in LINEARS] + [model.lm_head]:
        if hasattr(linear, "qweight"):
            linear.qweight = linear.qweight.clone()
    return engine


if "--memory" in sys.argv:
    engines = {"int8 tiled, 2 MB pages": load(),
               "int8 row layout, 2 MB pages": load(tiled_int8=False),
               "int8 row layout, the file's pages": load(tiled_int8=False, hugepages=False),
               "int8 row layout, ordinary memory": cloned(load(tiled_int8=False, hugepages=False))}
    runs = {name: step_timer(e, 128) for name, e in engines.items()}
else:
    engine = Engine(path)

    def variant(fused: bool):
        def run():
            engine.model.fused_decode = fused
            return timer()
        return run

    timer = step_timer(engine, 128)
    runs = {"one call per step (decode_layers)": variant(True), "Python layer loop": variant(False)}
times = {name: [] for name in runs}
for _ in range(6):
    for name, run in runs.items():
        times[name].append(run())
for name, values in times.items():
    print(f"{name:40s} {statistics.median(values):6.2f} ms a step")
