"""A linear kernel (quantized, or dense bf16) at 1 to 512 rows of SmolLM2's linear shapes, for
two builds of the plugin library side by side: each round runs every library in a process of its
own, in turn, so a noisy neighbour slows them alike. Prints the median over rounds of each
library's median time and the second library's speed against the first's; writes JSON. No
timing is asserted anywhere.

    python benchmarks/ablations/quant_rows.py --kernel linear_w8a8 --libraries OLD.so NEW.so \\
        --isa avx2 avx512bf16 --threads 1 --json out/w8a8-rows.json
    python benchmarks/ablations/quant_rows.py --kernel linear_w4_tiled --libraries OLD.so NEW.so \\
        --isa avx2 --rows 1 8 16 64 128 --json out/w4-rows.json
    python benchmarks/ablations/quant_rows.py --kernel linear_w8 --shapes output --libraries OLD.so NEW.so \\
        --isa avx2 --rows 16 64 --calls 5    # SmolLM2's int8 output projection (49,152 x 576)
    python benchmarks/ablations/quant_rows.py --kernel linear_w4a8_tiled --group 192 --libraries OLD.so NEW.so \\
        --isa avx512amx --rows 16 64 512    # groups of 192 inputs (quantization.group_size: 192)
    python benchmarks/ablations/quant_rows.py --kernel linear_w8a8 --b-kernel linear_w8a8_tiled \\
        --libraries OLD.so NEW.so --isa avx512bf16    # W8A8's row layout (A) against the tiled one (B)

Kernels: linear_w8a8 (SmoothQuant's W8A8 on the row layout: int8_sq engines without AVX-512
VNNI), linear_w8a8_tiled (W8A8 on the tiled int8 layout: int8_sq engines where the host has
AVX-512 VNNI), linear_w8 (W8A16 on the int8 row layout: int8_wo engines where the tiled int8
layout is not used),
linear_w8_tiled (W8A16 on the tiled layout), linear_w4_tiled
(W4A16 on the tiled int4 layout: int4_awq / int4_wo) and linear_w4a8_tiled (W4A8), these two in
groups of --group inputs (default 64, as SmolLM2's int4 engines), linear (the dense bf16
kernel on the row layout: bf16 engines below AVX512-BF16) and linear_bf16_tiled (bf16 on the
tiled layout: bf16 engines on avx512bf16 and avx512amx). (A library is a built
kiln_plugins.so: build_plugins() prints the path of the current sources' one; an older commit's
stays in the build cache.)"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from library_turns import command_line, levels_and_rows, load, median_us

SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o_proj, gate_up, down
SHAPES = {"linears": SMOLLM2_SHAPES, "output": [(49152, 576)]}  # --shapes: the layers' or the output projection
ROWS = [1, 8, 32, 128]
KERNELS = ("linear_w8a8", "linear_w8a8_tiled", "linear_w8", "linear_w8_tiled", "linear_w4_tiled",
           "linear_w4a8_tiled", "linear", "linear_bf16_tiled")


def call(ops, kernel: str, n: int, k: int, rows: int, g: torch.Generator, group: int):
    """One call of `kernel` on fresh weights of [n, k] and `rows` bf16 input rows (int4: in groups of
    `group` inputs, a last one shorter where it does not divide k)."""
    x = torch.randn(rows, k, generator=g).bfloat16()
    if kernel == "linear":
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        return lambda: ops.linear(x, w)
    if kernel == "linear_bf16_tiled":
        w = ops.pack_bf16_tiled((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16())
        return lambda: ops.linear_bf16_tiled(x, w)
    if kernel == "linear_w8a8":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s = torch.rand(n, generator=g) + 0.5
        wsum = w.to(torch.int32).sum(dim=1, dtype=torch.int32)
        return lambda: ops.linear_w8a8(x, w, s, wsum)
    if kernel == "linear_w8a8_tiled":
        w = ops.pack_int8_tiled(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g))
        s = torch.rand(n, generator=g) + 0.5
        return lambda: ops.linear_w8a8_tiled(x, w, s)
    if kernel in ("linear_w8", "linear_w8_tiled"):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        s = torch.rand(n, generator=g) * 0.01
        if kernel == "linear_w8_tiled":
            w = ops.pack_int8_tiled(w)
        return lambda: getattr(ops, kernel)(x, w, s)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, -(-k // group), generator=g) * 0.01
    tiled, tiled_scales = ops.pack_int4_tiled(packed, scales, group)
    op = getattr(ops, kernel)
    return lambda: op(x, tiled, tiled_scales, group)


def measure(library: str, isas: list[str], threads: int, calls: int, row_counts: list[int], kernel: str,
            shapes: str, group: int, b_kernel: str | None, turn: int) -> list[dict]:
    """Median microseconds of `kernel` (library B: `b_kernel` where given) at each (isa, rows, shape) in
    this process, on `library`."""
    ops, g = load(library, threads, 20261202)
    kernel = b_kernel if turn == 1 and b_kernel else kernel
    out = []
    for isa, rows in levels_and_rows(ops, isas, row_counts):
        for n, k in SHAPES[shapes]:
            out.append({"isa": isa, "rows": rows, "shape": f"{n}x{k}",
                        "median_us": median_us(call(ops, kernel, n, k, rows, g, group), calls, 3)})
    return out


def main() -> None:
    args, runs = command_line(__file__, __doc__, measure, 50, ROWS, two=True,
                              options={"--kernel": dict(choices=KERNELS, default="linear_w8a8"),
                                       "--shapes": dict(choices=tuple(SHAPES), default="linears"),
                                       "--group": dict(type=int, default=64,
                                                       help="int4 kernels: inputs a scale covers"),
                                       "--b-kernel": dict(choices=KERNELS, default=None,
                                                          help="library B runs this kernel instead (two "
                                                               "layouts of one kind side by side)")})
    a, b = args.libraries
    rows = []
    for i, entry in enumerate(runs[a][0]):
        ta = statistics.median(r[i]["median_us"] for r in runs[a])
        tb = statistics.median(r[i]["median_us"] for r in runs[b])
        rows.append({**{k: entry[k] for k in ("isa", "rows", "shape")}, "a_us": ta, "b_us": tb, "b_speedup": ta / tb})
    from rich.console import Console
    from rich.table import Table

    grouped = f" in groups of {args.group}" if "w4" in args.kernel else ""
    kernels = f"{args.kernel} (B: {args.b_kernel})" if args.b_kernel else args.kernel
    table = Table(title=f"{kernels}{grouped}, bf16 rows, {args.threads} thread(s), median of {args.rounds} "
                        f"rounds x {args.calls} calls; A = {Path(a).parent.name}, B = {Path(b).parent.name}")
    for column in ("isa", "rows", "shape", "A µs", "B µs", "A / B"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["isa"], str(r["rows"]), r["shape"], f"{r['a_us']:.1f}", f"{r['b_us']:.1f}",
                      f"{r['b_speedup']:.2f}x")
    Console(width=160).print(table)
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from host import host_info

        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "kernel": args.kernel, "b_kernel": args.b_kernel, "shapes": args.shapes,
                "group": args.group, "threads": args.threads, "calls": args.calls, "rounds": args.rounds,
                "libraries": args.libraries}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
