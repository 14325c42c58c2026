"""Where a loaded engine's weights sit: one arena of 2 MB pages in decode-step order (the default,
runtime/weight_arena.py), against each large weight in 2 MB pages of its own (Engine(...,
weight_arena=False)).

Memory: each engine loaded in a process of its own per setting (the plugin library loaded
first, so only the engine's own memory is counted): the growth of VmRSS, of its anonymous and
file-backed parts, and of AnonHugePages, the peak while loading (VmHWM over the VmRSS before),
and the load's seconds.
Speed: both settings loaded in one process, one-token decode steps at ~190 cached tokens (the
output projection and Python included), the two taking turns round by round; medians of
--rounds rounds of 64 steps per thread count.

    cd benchmarks/ablations
    PYTHONPATH=../.. python weight_arena.py ../../out/smollm2-int4-awq/engine ../../out/smollm2-bf16/engine \\
        --threads 1 2 --rounds 15 --json OUT.json

Prints tables and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SETTINGS = {"apart": False, "arena": True}  # name -> Engine's weight_arena
# the memory table: (title, measure_load's key, width, decimals)
MEMORY_COLUMNS = [("RSS MB", "VmRSS_MB", 9, 0), ("anon", "RssAnon_MB", 8, 0), ("file", "RssFile_MB", 8, 0),
                  ("2 MB pages", "AnonHugePages_MB", 12, 0), ("peak", "peak_MB", 8, 0), ("load s", "load_s", 8, 2)]


def status_mb() -> dict[str, float]:
    """VmRSS, its peak VmHWM, RssAnon, RssFile (/proc/self/status) and AnonHugePages (smaps_rollup), in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages"):
            out["AnonHugePages"] = int(line.split()[1]) / 1024
    return out


def measure_load(engine_dir: str, arena: bool) -> dict:
    """In this process: the memory an engine's load adds, and how long it takes."""
    from kiln.plugins import ops
    from kiln.runtime.engine import Engine, read_engine_json
    from kiln.runtime.weight_arena import streamed

    ops.load_library(Path(engine_dir) / read_engine_json(Path(engine_dir))["plugins"]["file"])
    before = status_mb()
    start = time.perf_counter()
    engine = Engine(engine_dir, weight_arena=arena)
    seconds = time.perf_counter() - start
    after = status_mb()
    storages = {getattr(owner, attr).untyped_storage().data_ptr() for owner, attr in streamed(engine.model)}
    grown = {f"{k}_MB": after[k] - before[k] for k in after if k != "VmHWM"}
    return {"load_s": seconds, **grown, "peak_MB": after["VmHWM"] - before["VmRSS"],
            "streamed_storages": len(storages)}


def time_steps(engine_dir: str, threads: list[int], rounds: int, cached: int) -> list[dict]:
    """In this process: both settings loaded, decode steps taking turns round by round."""
    from decode_steps import step_timer
    from kiln.runtime.engine import Engine

    engines = {name: Engine(engine_dir, weight_arena=arena) for name, arena in SETTINGS.items()}
    out = []
    for count in threads:
        torch.set_num_threads(count)
        runs = {name: step_timer(engine, cached) for name, engine in engines.items()}
        times = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(run())
        medians = {name: statistics.median(values) for name, values in times.items()}
        out.append({"engine": engine_dir, "threads": count, "medians_ms": medians, "rounds_ms": times,
                    "apart_over_arena": medians["apart"] / medians["arena"]})
    return out


def in_subprocess(*args: str):
    """This script's JSON answer to args, from a process of its own (one plugin library per process)."""
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cached", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--load-only", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.load_only:
        print(json.dumps(measure_load(args.engines[0], args.load_only == "on")))
        return
    if args.speed_only:
        print(json.dumps(time_steps(args.engines[0], args.threads, args.rounds, args.cached)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from host import host_info

    memory, speed = [], []
    print(f"{'engine':<34}{'setting':>8}" + "".join(f"{title:>{width}}" for title, _, width, _ in MEMORY_COLUMNS))
    for engine_dir in args.engines:
        for name, arena in SETTINGS.items():
            row = {"engine": engine_dir, "setting": name,
                   **in_subprocess(engine_dir, "--load-only", "on" if arena else "off")}
            memory.append(row)
            print(f"{Path(engine_dir).parent.name:<34}{name:>8}"
                  + "".join(f"{row[key]:>{width}.{digits}f}" for _, key, width, digits in MEMORY_COLUMNS))
    print(f"\n{'engine':<34}{'threads':>8}" + "".join(f"{name + ' ms':>11}" for name in SETTINGS)
          + f"{'apart/arena':>13}")
    for engine_dir in args.engines:
        rows = in_subprocess(engine_dir, "--speed-only", "--rounds", str(args.rounds), "--cached", str(args.cached),
                             "--threads", *map(str, args.threads))
        for row in rows:
            medians = row["medians_ms"]
            print(f"{Path(engine_dir).parent.name:<34}{row['threads']:>8}"
                  + "".join(f"{medians[n]:>11.3f}" for n in SETTINGS) + f"{row['apart_over_arena']:>12.2f}x")
        speed += rows
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "cached": args.cached, "rounds": args.rounds}
        args.json.write_text(json.dumps({"meta": meta, "memory": memory, "speed": speed}, indent=2))


if __name__ == "__main__":
    main()
