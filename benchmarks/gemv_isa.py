"""The quantized GEMVs of a decode step on each kernel level, side by side: for each of SmolLM2's
linear shapes and each kernel kind (int4 tiled W4A16, W4A8 tiled, int8 W8A16 rows, SmoothQuant
W8A8, bf16), one bf16 input row, the kernel levels taking turns call by call (so a noisy
neighbour slows them alike), one thread by default. Prints median microseconds, the weight
read rate and each level against the first; writes JSON. No timing is asserted anywhere.

    python benchmarks/gemv_isa.py --isa avx2 avx2vnni avx512bf16 --json out/gemv-isa.json

Weights are the same random tensors on every level, laid out as the runtime lays them out for
that level (tiled int4 on every level); a level the CPU lacks is an error."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from host import host_info
from rich.console import Console
from rich.table import Table

# SmolLM2-135M's decode-step linears (out_features, in_features): fused qkv, o_proj, gate_up, down
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
GROUP = 64


def kernels(n: int, k: int, g: torch.Generator) -> dict:
    """kind -> (a function of the input row, weight bytes it reads)."""
    from kiln.plugins import ops

    w4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s4 = torch.rand(n, -(-k // GROUP), generator=g) + 0.5
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g) + 0.5
    w8sum = w8.to(torch.int32).sum(dim=1, dtype=torch.int32)
    wb = torch.randn(n, k, generator=g).bfloat16()
    t4, ts4 = ops.pack_int4_tiled(w4, s4, GROUP)
    return {"int4 tiled": (lambda x: ops.linear_w4_tiled(x, t4, ts4, GROUP), n * k // 2),
            "w4a8 tiled": (lambda x: ops.linear_w4a8_tiled(x, t4, ts4, GROUP), n * k // 2),
            "int8 rows": (lambda x: ops.linear_w8(x, w8, s8), n * k),
            "w8a8": (lambda x: ops.linear_w8a8(x, w8, s8, w8sum), n * k),
            "bf16": (lambda x: ops.linear(x, wb), 2 * n * k)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="+", default=["avx2", "avx2vnni", "avx512bf16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per kernel and level")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins

    ops.load_library(build_plugins())
    torch.set_num_threads(args.threads)
    start_isa = ops.active_isa()
    g = torch.Generator().manual_seed(20261201)
    rows = []
    try:
        for n, k in SMOLLM2_SHAPES:
            x = torch.randn(1, k, generator=g).bfloat16()
            for kind, (run, nbytes) in kernels(n, k, g).items():
                times = {isa: [] for isa in args.isa}
                for isa in args.isa:  # warm up each level
                    ops.select_isa(isa)
                    for _ in range(5):
                        run(x)
                for _ in range(args.calls):
                    for isa in args.isa:
                        ops.select_isa(isa)
                        t0 = time.perf_counter()
                        run(x)
                        times[isa].append(time.perf_counter() - t0)
                for isa in args.isa:
                    median = statistics.median(times[isa])
                    rows.append({"shape": f"{n}x{k}", "kernel": kind, "isa": isa, "median_us": 1e6 * median,
                                 "GBps": nbytes / median / 1e9,
                                 "vs_first": statistics.median(times[args.isa[0]]) / median})
    finally:
        ops.select_isa(start_isa)

    table = Table(title=f"GEMV, one bf16 row, {args.threads} thread(s), median of {args.calls} calls per level")
    for column in ("shape", "kernel", *(f"{isa} µs" for isa in args.isa), *(f"{isa} / {args.isa[0]}" for isa in args.isa[1:])):
        table.add_column(column, justify="right")
    for i in range(0, len(rows), len(args.isa)):
        group = rows[i : i + len(args.isa)]
        table.add_row(group[0]["shape"], group[0]["kernel"], *(f"{r['median_us']:.1f}" for r in group),
                      *(f"{r['vs_first']:.2f}x" for r in group[1:]))
    Console(width=160).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "threads": args.threads, "calls": args.calls, "isa": args.isa}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
