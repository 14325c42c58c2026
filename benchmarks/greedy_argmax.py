"""Greedy sampling's argmax over a step's logits: PyTorch's CPU argmax against
kiln.runtime.sampling.greedy_tokens (NumPy's), side by side, call by call in turn, for a few row
counts and thread counts. Prints median microseconds and writes JSON. No timing is asserted.

    python benchmarks/greedy_argmax.py --vocab 49152 --rows 1 16 --threads 1 2 --json out/greedy-argmax.json
"""
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

from kiln.runtime.sampling import greedy_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    ways = {"torch.argmax": lambda x: torch.argmax(x, dim=-1).tolist(), "greedy_tokens (NumPy)": greedy_tokens}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for count in args.rows:
            logits = torch.randn(count, args.vocab, generator=torch.Generator().manual_seed(count))
            assert ways["torch.argmax"](logits) == greedy_tokens(logits)
            times = {name: [] for name in ways}
            for _ in range(args.calls):
                for name, way in ways.items():
                    start = time.perf_counter()
                    way(logits)
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["torch.argmax"])
            rows += [{"threads": threads, "rows": count, "way": name, "us": 1e6 * statistics.median(t),
                      "vs_torch": base / statistics.median(t)} for name, t in times.items()]

    table = Table(title=f"argmax over [rows, {args.vocab}] float32 logits, median of {args.calls} calls")
    for column in ("threads", "rows", "way", "µs", "× torch"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["threads"]), str(row["rows"]), row["way"], f"{row['us']:.1f}", f"{row['vs_torch']:.1f}x")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
