"""Each linear of an engine at many row counts, two ways side by side: kiln's kernel (the
linear's `gemv`, which reads the packed weights) against the dense route (`dense`: the weights
dequantized, then PyTorch's GEMM), taking turns call by call. It shows where a batched step's
linears are cheaper in kiln's kernels, the row count at which each linear kind should change route.

    PYTHONPATH=. python benchmarks/ablations/linear_rows.py --engine out/smollm2-int4-awq/engine \
        --rows 1 4 8 9 16 32 64 128 --threads 1 2 --json out/linear-rows.json

Times layer 0's linears (one of each shape) and the output projection; prints medians per
(linear, rows) and writes JSON. A bf16 linear on the tiled layout (avx512bf16, avx512amx) has one
route; its dense side is PyTorch's GEMM on the weight unpacked to [out, in]. No timing is asserted
anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_info  # noqa: E402


def linears(engine) -> dict[str, object]:
    """name -> linear: layer 0's and the output projection."""
    return {**engine.model.layers[0].linears(), "lm_head": engine.model.lm_head}


def time_engine(engine_dir: str, row_counts: list[int], threads: list[int], repeats: int) -> list[dict]:
    from kiln.builder.tactics import median_us  # the build's own timing: one warm call, then the median
    from kiln import constants as names
    from kiln.plugins import reference
    from kiln.runtime.engine import Engine
    from kiln.runtime.linear import DenseLinear, gemm

    engine = Engine(engine_dir)
    gen = torch.Generator().manual_seed(0)
    results = []
    for t in threads:
        torch.set_num_threads(t)
        for name, lin in linears(engine).items():
            kernel = lambda x, lin=lin: lin.run(x, names.TACTIC_KILN)  # noqa: E731
            if isinstance(lin, DenseLinear) and lin.tiled:  # the tiled kernel is its only route
                weight = reference.unpack_bf16_tiled(lin.weight)
                dense = lambda x, lin=lin, weight=weight: gemm(x, weight, lin.bias)  # noqa: E731
            else:
                dense = lambda x, lin=lin: lin.run(x, names.TACTIC_TORCH)  # noqa: E731
            for rows in row_counts:
                x = torch.randn(rows, lin.features[0], generator=gen).to(engine.model.dtype)
                k_us, d_us = [], []
                for _ in range(3):  # turns
                    k_us.append(median_us(lambda: kernel(x), repeats))
                    d_us.append(median_us(lambda: dense(x), repeats))
                k, d = statistics.median(k_us), statistics.median(d_us)
                out_features = lin.features[1]
                row = {"engine": engine_dir, "linear": name, "kind": type(lin).__name__, "threads": t, "rows": rows,
                       "in": x.shape[1], "out": out_features, "kernel_us": k, "dense_us": d, "dense_over_kernel": d / k}
                results.append(row)
                print(f"{type(lin).__name__:>12} {name:>8} {x.shape[1]:>5}x{out_features:<6} threads {t} rows {rows:>4}: "
                      f"kernel {k:9.1f} us, dense {d:9.1f} us, dense/kernel {d / k:5.2f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [r for e in args.engine for r in time_engine(e, args.rows, args.threads, args.repeats)]
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host_info(), "command": " ".join(sys.argv), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
