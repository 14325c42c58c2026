"""Where a decode step's time goes, at ~190 cached tokens (after a 128-token prefill; --cached N).

Default: torch.profiler over 20 steps, ops sorted by their own time. The profiler adds a few
microseconds to every op, so small ops read high; the step time above the table has no profiler.
--python-loop profiles the model's Python layer loop instead of kiln::decode_layers (each kernel
call its own row).

--phases: inside kiln::decode_layers, which the profiler sees as one op, the library's own step
clock (ops.step_clock) splits each step into its linears, attention, norms, activation and
experts; the rest of decode_layers (argument checks, allocation) and of the step (embedding,
the output projection, Python) are the differences. Medians of --rounds rounds of 64 steps.
--team off on takes turns round by round between a step's threads forked and joined for every
kernel and kept in one region for the whole step (ops.set_decode_team), a column each.

    PYTHONPATH=. python benchmarks/ablations/decode_profile.py out/smollm2-int8-wo/engine [--python-loop] [--threads 2]
    PYTHONPATH=. python benchmarks/ablations/decode_profile.py out/smollm2-int4-awq/engine --phases --json out/phases.json
    PYTHONPATH=. python benchmarks/ablations/decode_profile.py out/smollm2-int4-awq/engine --phases --threads 2 --team off on"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import profile

from decode_steps import step_timer
from kiln.plugins import ops
from kiln.runtime.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from host import host_info  # noqa: E402

def phase_rounds(run, rounds: int) -> list[dict[str, float]]:
    """Per round: ms per step of each phase, of decode_layers' rest and of the step outside it."""
    out = []
    for _ in range(rounds):
        ops.step_clock(True)
        step_ms = run()
        clock = json.loads(ops.step_clock(False))
        per_step = {name: seconds * 1e3 / clock["calls"] for name, seconds in clock["seconds"].items()}
        row = {name: ms for name, ms in per_step.items() if name != "step"}  # the library's phases
        row["decode_layers, rest"] = per_step["step"] - sum(row.values())
        row["outside decode_layers"] = step_ms - per_step["step"]
        row["step"] = step_ms
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--python-loop", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cached", type=int, default=128, help="prompt tokens before the timed steps")
    parser.add_argument("--team", nargs="+", choices=["off", "on"], default=None,
                        help="with --phases: decode-team settings to take turns with, round by round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.team and not args.phases:
        parser.error("--team takes turns between rounds of --phases")
    torch.set_num_threads(args.threads)
    engine = Engine(args.engine)
    engine.model.fused_decode = not args.python_loop
    run = step_timer(engine, args.cached)
    if not args.phases:
        print(f"step {statistics.median(run() for _ in range(5)):.2f} ms")
        with profile() as prof:
            run(20)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        return
    if args.python_loop:
        parser.error("--phases times kiln::decode_layers; leave out --python-loop")
    settings = args.team or [None]
    rounds = {setting: [] for setting in settings}
    before = ops.set_decode_team(True) if args.team else None
    try:
        for _ in range(args.rounds):  # the settings take turns round by round
            for setting in settings:
                if setting is not None:
                    ops.set_decode_team(setting == "on")
                rounds[setting] += phase_rounds(run, 1)
    finally:
        if args.team:
            ops.set_decode_team(before)
    layers = engine.spec.num_layers
    medians = {setting: {name: statistics.median(r[name] for r in rounds[setting]) for name in rounds[setting][0]}
               for setting in settings}
    print(f"{args.engine}: {args.threads} thread(s), {layers} layers, {args.cached}-token prompt, "
          f"median of {args.rounds} rounds of 64 steps")
    if args.team:
        first, last = medians[settings[0]], medians[settings[-1]]
        print(f"{'ms / step':<24}" + "".join(f"{'team ' + s:>12}" for s in settings) + f"{'first/last':>11}")
        for name in first:
            if not any(medians[s][name] for s in settings):
                continue  # a phase this model lacks (experts)
            print(f"{name:<24}" + "".join(f"{medians[s][name]:>12.3f}" for s in settings)
                  + f"{first[name] / last[name] if last[name] > 0 else float('nan'):>10.2f}x")
    else:
        only = medians[None]
        print(f"{'phase':<24}{'ms / step':>10}{'share':>8}{'µs / layer':>12}")
        for name, ms in only.items():
            share = ms / only["step"]
            print(f"{name:<24}{ms:>10.3f}{share:>8.1%}{ms * 1e3 / layers:>12.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "engine": args.engine, "threads": args.threads, "cached": args.cached,
                "isa": ops.active_isa()}
        if args.team:
            result = {"medians_ms": {f"team {s}": medians[s] for s in settings},
                      "rounds_ms": {f"team {s}": rounds[s] for s in settings}}
        else:
            result = {"medians_ms": medians[None], "rounds_ms": rounds[None]}
        args.json.write_text(json.dumps({"meta": meta, **result}, indent=2))


if __name__ == "__main__":
    main()
