"""The row-wise ops of a decode step and a prefill (RMSNorm, the fused residual add + RMSNorm,
SwiGLU, GeGLU) in bf16 at SmolLM2's widths, for two or more builds of the plugin library side by
side: each round runs every library in a process of its own, in turn, so a noisy neighbour slows
them alike. Prints the median over rounds of each library's median time per call and each
library's speed against the first; writes JSON. No timing is asserted anywhere.

    python benchmarks/ablations/row_ops.py --libraries OLD.so NEW.so --isa avx2 avx512bf16 \\
        --rows 1 128 --json out/row-ops.json

(A library is a built kiln_plugins.so: build_plugins() prints the path of the current sources'
one; an older commit's stays in the build cache.)"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from library_turns import command_line, levels_and_rows, load, median_us

HIDDEN, INTERMEDIATE = 576, 1536  # SmolLM2-135M


def calls(rows: int, g: torch.Generator) -> dict:
    """op name -> a call of it on `rows` bf16 rows."""
    from kiln.plugins import ops

    x, residual = (torch.randn(rows, HIDDEN, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(HIDDEN, generator=g).bfloat16()
    gate_up = (torch.randn(rows, 2 * INTERMEDIATE, generator=g) * 4).bfloat16()
    return {"rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
            "add_rms_norm": lambda: ops.add_rms_norm(residual, x, w, 1e-6),
            "silu_mul": lambda: ops.silu_mul(gate_up),
            "gelu_tanh_mul": lambda: ops.gelu_tanh_mul(gate_up)}


def measure(library: str, isas: list[str], threads: int, count: int, row_counts: list[int]) -> list[dict]:
    """Median microseconds of each (isa, rows, op) in this process, on `library`."""
    ops, g = load(library, threads, 20261203)
    out = []
    for isa, rows in levels_and_rows(ops, isas, row_counts):
        for name, call in calls(rows, g).items():
            out.append({"isa": isa, "rows": rows, "op": name, "median_us": median_us(call, count, count // 10)})
    return out


def main() -> None:
    args, runs = command_line(__file__, __doc__, measure, 1000, [1, 128])
    rows = []
    first = args.libraries[0]
    for i, cell in enumerate(runs[first][0]):
        medians = {lib: statistics.median(run[i]["median_us"] for run in runs[lib]) for lib in args.libraries}
        rows.append({"isa": cell["isa"], "rows": cell["rows"], "op": cell["op"], "median_us": medians,
                     "speedup": {lib: medians[first] / medians[lib] for lib in args.libraries}})
    names = [Path(lib).parent.name for lib in args.libraries]
    print(f"{'isa':>11} {'rows':>5} {'op':>14} " + " ".join(f"{n[:16]:>16}" for n in names) + "   × first")
    for row in rows:
        times = " ".join(f"{row['median_us'][lib]:14.2f}us" for lib in args.libraries)
        ratios = " ".join(f"{row['speedup'][lib]:.2f}x" for lib in args.libraries[1:])
        print(f"{row['isa']:>11} {row['rows']:>5} {row['op']:>14} {times}   {ratios}")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from host import host_info

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": {**host_info(), "args": vars(args) | {"json": str(args.json)},
                                                  "threads": args.threads}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
