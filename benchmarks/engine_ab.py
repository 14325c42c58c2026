"""Two or more engines' batch-1 decode side by side, one process per run, the engines taking
turns round by round (so a noisy neighbour slows them alike). Each engine carries its own plugin
library, and one process can load only one, so this is how two builds of kiln compare: build
the same config with each and give both engine folders, or give one engine and two or more
plugin libraries (--library): each gets a copy of the engine holding that library, its checksums
updated (the weights linked, not copied).

    python benchmarks/engine_ab.py --engine old=out/old/engine --engine new=out/new/engine \\
        --isa avx2 --threads 1 2 --rounds 7 --json out/engine-ab.json
    python benchmarks/engine_ab.py --engine out/smollm2-int4-awq/engine \\
        --library old=OLD/kiln_plugins.so --library new=NEW/kiln_plugins.so --threads 1 2

Each run is benchmarks/decode_latency.py on one engine, one thread count and one kernel level
(a warm-up, then --repeats timed runs); the table gives the median over rounds of each run's
median decode tok/s, and each engine against the first. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from host import host_info
from kiln import constants as names
from kiln.runtime.engine import sha256_file
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent


def one_run(engine: str, threads: int, isa: str | None, args: argparse.Namespace) -> float:
    """Decode tok/s of one child process (decode_latency.py on this engine alone)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, str(HERE / "decode_latency.py"), "--engine", engine, "--threads", str(threads),
                   "--repeats", str(args.repeats), "--prompt-tokens", str(args.prompt_tokens),
                   "--decode-tokens", str(args.decode_tokens), "--json", str(out)]
        if isa:
            command += ["--isa", isa]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{engine}: decode_latency.py failed:\n{done.stderr[-2000:]}")
        (row,) = json.loads(out.read_text())["rows"]
        return row["decode_tok_s"]


def with_library(engine: Path, library: Path, dest: Path) -> Path:
    """A copy of the engine folder at dest whose plugin library is `library`: engine.json's and
    MANIFEST.json's checksums updated, every other file hard-linked (or copied across devices)."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    def rewrite(name: str, content: dict) -> None:  # a new file, not the original it is linked to
        (dest / name).unlink()
        (dest / name).write_text(json.dumps(content, indent=2))

    shutil.copytree(engine, dest, copy_function=link)
    meta = json.loads((engine / names.ENGINE_JSON).read_text())
    plugin = dest / meta["plugins"]["file"]
    plugin.unlink()
    shutil.copy2(library, plugin)
    meta["plugins"]["sha256"] = sha256_file(plugin)
    rewrite(names.ENGINE_JSON, meta)
    manifest = json.loads((engine / names.MANIFEST_FILE).read_text())
    manifest["files"][meta["plugins"]["file"]] = meta["plugins"]["sha256"]
    manifest["files"][names.ENGINE_JSON] = sha256_file(dest / names.ENGINE_JSON)
    rewrite(names.MANIFEST_FILE, manifest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", required=True, metavar="NAME=DIR",
                        help="a name and an engine folder (repeatable; the first is the baseline), or with "
                             "--library one engine folder")
    parser.add_argument("--library", action="append", default=[], metavar="NAME=PATH",
                        help="a name and a plugin library to run the one --engine with (repeatable; the first "
                             "is the baseline)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isa", nargs="+", default=[None], help="kernel levels to run each engine on")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs in each process, after a warm-up")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    libraries = dict(item.split("=", 1) for item in args.library)
    if libraries:
        if len(args.engine) != 1 or len(libraries) < 2:
            parser.error("--library takes one --engine and at least two libraries, as NAME=PATH")
        engine = Path(args.engine[0].split("=")[-1])
        # next to the engine's own folder, so the copies can hard-link its files
        copies = tempfile.TemporaryDirectory(dir=engine.resolve().parent.parent)
        engines = {name: str(with_library(engine, Path(path), Path(copies.name) / name))
                   for name, path in libraries.items()}
    else:
        engines = dict(item.split("=", 1) for item in args.engine)
    if len(engines) < 2:
        parser.error("give at least two engines, as NAME=DIR")

    rates: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            for isa in args.isa:
                for name, folder in engines.items():
                    rates.setdefault((threads, isa, name), []).append(one_run(folder, threads, isa, args))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    rows = []
    for (threads, isa, name), values in rates.items():
        first = rates[(threads, isa, next(iter(engines)))]
        rows.append({"threads": threads, "isa": isa, "engine": name, "dir": engines[name],
                     "library": libraries.get(name),
                     "decode_tok_s": statistics.median(values), "runs": values,
                     "vs_first": statistics.median(values) / statistics.median(first)})
    table = Table(title=f"batch-1 decode, {args.decode_tokens} tokens after a {args.prompt_tokens}-token prompt; "
                        f"median of {args.rounds} alternating processes")
    for column in ("threads", "level", "engine", "decode tok/s", "runs min-max", "× first"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["threads"]), row["isa"] or "auto", row["engine"], f"{row['decode_tok_s']:.1f}",
                      f"{min(row['runs']):.0f}-{max(row['runs']):.0f}", f"{row['vs_first']:.2f}x")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
