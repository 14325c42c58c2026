"""The side-by-side runs of the ablations that time ops on several builds of the plugin library
(one library a process): each round runs the calling script once per library, each in a process
of its own, in turn, so a noisy neighbour slows them alike. command_line() is their shared
command line; in the subprocess it runs the script's measure() and prints its JSON."""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

from kiln.builder.tactics import median_us  # noqa: F401  (row_ops.py and quant_rows.py time with it)


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


def levels_and_rows(ops, isas: list[str], row_counts: list[int]):
    """(isa, rows) for every kernel level and row count, each level selected before its rows."""
    for isa in isas:
        ops.select_isa(isa)
        for rows in row_counts:
            yield isa, rows


def command_line(script: str, description: str, measure, calls: int, rows: list[int], two: bool = False,
                 options: dict[str, dict] | None = None):
    """Parse --libraries (two only, A and B, where `two`), --isa, --threads, --calls, --rounds, --rows,
    --json, and the script's own `options` ({flag: add_argument's keywords}). In the subprocess
    (--measure LIBRARY): print measure(library, isas, threads, calls, rows, **options' values)'s JSON
    (and turn=, the library's place in --libraries, where measure takes it) and exit. Otherwise ->
    (args, in_turns's runs), the subprocesses given the same options (those not None)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if two:
        parser.add_argument("--libraries", nargs=2, required=True, metavar=("A", "B"))
    else:
        parser.add_argument("--libraries", nargs="+", required=True)
    parser.add_argument("--isa", nargs="+", default=["avx2", "avx512bf16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # (one library, in a subprocess)
    for flag, keywords in (options or {}).items():
        parser.add_argument(flag, **keywords)
    args = parser.parse_args()
    own = {flag: getattr(args, flag.lstrip("-").replace("-", "_")) for flag in options or {}}
    if args.measure:
        values = {flag.lstrip("-").replace("-", "_"): value for flag, value in own.items()}
        if "turn" in inspect.signature(measure).parameters:  # which of --libraries this process runs
            values["turn"] = args.libraries.index(args.measure)
        print(json.dumps(measure(args.measure, args.isa, args.threads, args.calls, args.rows, **values)))
        sys.exit(0)
    passed_on = [word for flag, value in own.items() if value is not None for word in (flag, str(value))]
    return args, in_turns(script, args.libraries, args.rounds, ["--isa", *args.isa, "--threads", str(args.threads),
                                                               "--calls", str(args.calls), "--rows", *map(str, args.rows),
                                                               *passed_on])
