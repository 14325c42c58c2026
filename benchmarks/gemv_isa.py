"""The quantized GEMVs of a decode step on each kernel level, side by side: for each of SmolLM2's
linear shapes and each kernel kind (int4 tiled W4A16, W4A8 tiled, int8 W8A16 rows, SmoothQuant
W8A8, FP8 weights, bf16), one bf16 input row, the kernel levels taking turns call by call (so a noisy
neighbour slows them alike), one thread by default. Prints median microseconds, the weight
read rate and each level against the first; writes JSON. No timing is asserted anywhere.

    python benchmarks/gemv_isa.py --isa avx2 avx2vnni avx512bf16 --json out/gemv-isa.json

Weights are the same random tensors on every level, laid out as the runtime lays them out for
that level (tiled int4 on every level); a level the CPU lacks is an error.

By default the weights stay in cache (the arithmetic is timed). --cold MB makes enough copies of
each weight that the copies together exceed MB and each call reads the next one, as a decode
step reads every weight from memory once (the memory-bound rate, next to a `sum`'s read rate in
the same run); every copy is read once, untimed, before the timed calls:

    python benchmarks/gemv_isa.py --isa avx2vnni avx512bf16 --cold 256

--rows N times calls of N input rows instead (a step of N sequences), --kinds picks kernel kinds
("int8 tiled": W8A16 on the tiled int8 layout, AVX-512 engines' int8 linears; "bf16 rows": bf16
on the row layout on every level; bf16 and W8A8 run on their tiled layouts on the levels that
lay them out so, as engines do there: bf16 on avx512bf16 and avx512amx, W8A8 on the AVX-512
VNNI levels) and --output-projection adds the output projection's shape (49,152 x 576):

    python benchmarks/gemv_isa.py --isa avx512bf16 avx512amx --rows 16 --kinds "int4 tiled" \
        "w4a8 tiled" "int8 tiled" --output-projection"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from host import host_info, read_bandwidth
from rich.console import Console
from rich.table import Table

# SmolLM2-135M's decode-step linears (out_features, in_features): fused qkv, o_proj, gate_up, down
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
OUTPUT_PROJECTION = (49152, 576)
GROUP = 64


KINDS = ["int4 tiled", "w4a8 tiled", "int8 rows", "w8a8", "fp8", "bf16"]
EXTRA_KINDS = ["int8 tiled", "bf16 rows"]  # only with --kinds
TILED = {"bf16": False, "w8a8": False}  # whether the level being timed lays these out tiled, set per turn


def kernel(kind: str, n: int, k: int, g: torch.Generator):
    """(a function of the input row, the weight bytes it reads) for one kernel kind, on fresh
    random weights laid out as the runtime lays them out."""
    from kiln.plugins import ops

    if kind in ("int4 tiled", "w4a8 tiled"):
        w4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        s4 = torch.rand(n, -(-k // GROUP), generator=g) + 0.5
        t4, ts4 = ops.pack_int4_tiled(w4, s4, GROUP)
        run = ops.linear_w4_tiled if kind == "int4 tiled" else ops.linear_w4a8_tiled
        return (lambda x: run(x, t4, ts4, GROUP)), t4.nbytes + ts4.nbytes
    s8 = torch.rand(n, generator=g) + 0.5
    if kind == "int8 tiled":
        t8 = ops.pack_int8_tiled(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        return (lambda x: ops.linear_w8_tiled(x, t8, s8)), t8.nbytes + s8.nbytes
    if kind in ("int8 rows", "w8a8"):
        w8 = ops.to_hugepages(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        if kind == "int8 rows":
            return (lambda x: ops.linear_w8(x, w8, s8)), w8.nbytes + s8.nbytes
        w8sum = w8.to(torch.int32).sum(dim=1, dtype=torch.int32)
        if not ops.w8a8_tiles_fit(n, k):
            return (lambda x: ops.linear_w8a8(x, w8, s8, w8sum)), w8.nbytes + s8.nbytes
        t8 = ops.to_hugepages(ops.pack_int8_tiled(w8))  # the layout of the AVX-512 VNNI levels (a second copy)
        return (lambda x: ops.linear_w8a8_tiled(x, t8, s8) if TILED["w8a8"] else ops.linear_w8a8(x, w8, s8, w8sum)), \
            w8.nbytes + s8.nbytes
    if kind == "fp8":
        wf8 = ops.to_hugepages((torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn))
        return (lambda x: ops.linear_fp8(x, wf8, s8)), wf8.nbytes + s8.nbytes
    wb = ops.to_hugepages(torch.randn(n, k, generator=g).bfloat16())
    if kind == "bf16 rows" or not ops.bf16_tiles_fit(n, k):
        return (lambda x: ops.linear(x, wb)), wb.nbytes
    wt = ops.to_hugepages(ops.pack_bf16_tiled(wb))  # the layout of the BF16 levels (a second copy)
    return (lambda x: ops.linear_bf16_tiled(x, wt) if TILED["bf16"] else ops.linear(x, wb)), wb.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="+", default=["avx2", "avx2vnni", "avx512bf16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per kernel and level")
    parser.add_argument("--cold", type=float, default=0, metavar="MB",
                        help="rotate through copies of each weight exceeding MB (0: one copy, in cache)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=None, metavar="BYTES",
                        help="software prefetch distances to take turns with on each level (0: none)")
    parser.add_argument("--rows", type=int, default=1, help="input rows a call (1: a decode step of one sequence)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS + EXTRA_KINDS, default=KINDS)
    parser.add_argument("--output-projection", action="store_true", help="also the 49,152 x 576 output projection")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins

    ops.load_library(build_plugins())
    torch.set_num_threads(args.threads)
    start_isa, start_prefetch = ops.active_isa(), ops.set_prefetch(0)
    ops.set_prefetch(start_prefetch)
    # the variants taking turns: each level, at each prefetch distance asked for
    variants = [(isa, pf) for isa in args.isa for pf in (args.prefetch or [start_prefetch])]
    names = [isa if not args.prefetch else f"{isa} pf {pf}" for isa, pf in variants]
    g = torch.Generator().manual_seed(20261201)
    tiled = {}
    for isa in args.isa:
        ops.select_isa(isa)
        tiled[isa] = {layout: ops.tiled(layout) for layout in TILED}
    ops.select_isa(start_isa)
    rows = []
    try:
        for n, k in SMOLLM2_SHAPES + ([OUTPUT_PROJECTION] if args.output_projection else []):
            x = torch.randn(args.rows, k, generator=g).bfloat16()
            for kind in args.kinds:
                copies = [kernel(kind, n, k, g)]
                nbytes = copies[0][1]
                while len(copies) * nbytes < args.cold * 1e6:
                    copies.append(kernel(kind, n, k, g))
                # one untimed call on every copy first: on a Zen 5 VM the first read of freshly
                # written copies ran up to 7x slower than later reads of them (a 166 KB GEMV took
                # 60-110 µs instead of 12-16; docs/benchmarks.md), which the timed calls would catch
                for run, _ in copies:
                    run(x)
                runs = itertools.cycle([run for run, _ in copies])
                times = {name: [] for name in names}
                for isa, pf in variants:  # warm up each variant
                    ops.select_isa(isa), ops.set_prefetch(pf)
                    TILED.update(tiled[isa])
                    for _ in range(5):
                        next(runs)(x)
                for _ in range(args.calls):
                    for name, (isa, pf) in zip(names, variants):
                        ops.select_isa(isa), ops.set_prefetch(pf)
                        TILED.update(tiled[isa])
                        run = next(runs)
                        t0 = time.perf_counter()
                        run(x)
                        times[name].append(time.perf_counter() - t0)
                for name, (isa, pf) in zip(names, variants):
                    median = statistics.median(times[name])
                    rows.append({"shape": f"{n}x{k}", "kernel": kind, "isa": isa, "prefetch_bytes": pf,
                                 "variant": name, "median_us": 1e6 * median, "GBps": nbytes / median / 1e9,
                                 "vs_first": statistics.median(times[names[0]]) / median})
                del copies, runs
    finally:
        ops.select_isa(start_isa), ops.set_prefetch(start_prefetch)

    bandwidth = read_bandwidth(args.threads) if args.cold else None
    where = f"weights from memory (> {args.cold:g} MB of copies)" if args.cold else "weights in cache"
    table = Table(title=f"GEMV, {args.rows} bf16 row(s), {args.threads} thread(s), {where}, "
                        f"median of {args.calls} calls per level")
    for column in ("shape", "kernel", *(f"{name} µs" for name in names), *(f"{name} GB/s" for name in names),
                   *(f"{name} / {names[0]}" for name in names[1:])):
        table.add_column(column, justify="right")
    for i in range(0, len(rows), len(names)):
        group = rows[i : i + len(names)]
        table.add_row(group[0]["shape"], group[0]["kernel"], *(f"{r['median_us']:.1f}" for r in group),
                      *(f"{r['GBps']:.1f}" for r in group), *(f"{r['vs_first']:.2f}x" for r in group[1:]))
    Console(width=200).print(table)
    if bandwidth:
        print(f"read bandwidth (a sum over 1 GiB, {args.threads} thread(s)): {bandwidth / 1e9:.1f} GB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "threads": args.threads, "calls": args.calls, "isa": args.isa, "prefetch": args.prefetch,
                "cold_mb": args.cold, "rows": args.rows, "kinds": args.kinds,
                "read_bandwidth_GBps": bandwidth and bandwidth / 1e9}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
