"""Prefill budgets beside decoding streams, side by side under the same closed-loop load, in
process: output tokens/s, the steady state's time to first token and inter-token times (p50,
p99 and their ratio) for each setting of the scheduler's run-time options (max_prefill_share,
prefill_per_decode, prefill_max_wait).

Each round sends the same fresh prompts to every setting in turn (one engine each, all loaded
at the start): kiln bench's closed loop, --concurrency clients each sending its next request
when the last ends, every request --prompt-tokens of prose and exactly --output-tokens new
tokens. "Steady" leaves out the first wave (every client's first request, all sent at once):
its prompts arrive together, so its prefill is a burst whatever the budget.

    PYTHONPATH=. python benchmarks/ablations/prefill_budget.py out/smollm2-int4-awq/engine \
        --settings max_prefill_share=0.25 prefill_per_decode=1.5,prefill_max_wait=2 \
        --concurrency 16 64 --rounds 2 --json out/prefill-budget.json

Prompts are real prose (Python's pydoc topics, kiln.bench.synthetic_prompts), a different passage
each; prefix reuse is off. Prints medians over the rounds and writes JSON. No timing is asserted
anywhere."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_info  # noqa: E402


def measure(result: dict) -> dict:
    """kiln bench's closed-loop result -> this table's figures (steady: after the first wave)."""
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors']}")
    steady = result["steady"]
    row = {"tokens_per_s": result["output_tokens_per_s"],
           "ttft_steady_p50_ms": steady["ttft_ms"]["p50"], "ttft_steady_p99_ms": steady["ttft_ms"]["p99"],
           "itl_steady_p50_ms": steady["itl_ms"]["p50"], "itl_steady_p99_ms": steady["itl_ms"]["p99"]}
    row["itl_p99_over_p50"] = row["itl_steady_p99_ms"] / row["itl_steady_p50_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine")
    parser.add_argument("--settings", nargs="+", required=True, metavar="KEY=VALUE,...",
                        help="run-time options to compare, each a comma-separated list (JSON values)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=8, help="requests = this x concurrency")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    from kiln.bench import EngineTarget, run_concurrency, runtime_options, synthetic_prompts

    console = Console(stderr=True)
    options = [runtime_options(setting.split(",")) for setting in args.settings]
    targets = [EngineTarget(args.engine, **option, enable_prefix_reuse=False) for option in options]
    runs: dict[tuple[int, str], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for level in args.concurrency:
                prompts = synthetic_prompts(targets[0].tokenizer, args.waves * level, args.prompt_tokens,
                                            seed=1000 * r + level)
                for setting, target in zip(args.settings, targets):
                    console.print(f"round {r + 1}, {level} streams, {setting} ...")
                    result = run_concurrency(target, prompts, level, args.output_tokens)
                    runs.setdefault((level, setting), []).append(measure(result))
    finally:
        for target in targets:
            target.close()

    rows = []
    for (level, setting), measured in runs.items():
        row = {"concurrency": level, "setting": setting, "rounds": measured}
        for key in measured[0]:
            row[key] = statistics.median(m[key] for m in measured)
        rows.append(row)
    table = Table(title=f"prefill budgets, {args.prompt_tokens}-token prompts, {args.output_tokens} new tokens, "
                        f"{args.threads} threads (medians of {args.rounds} rounds; steady: after the first wave)")
    for column in ("streams", "setting", "tok/s", "steady TTFT p50 ms", "p99", "steady ITL p50 ms", "p99",
                   "p99 / p50"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(str(row["concurrency"]), row["setting"], f"{row['tokens_per_s']:.1f}",
                      f"{row['ttft_steady_p50_ms']:.0f}", f"{row['ttft_steady_p99_ms']:.0f}",
                      f"{row['itl_steady_p50_ms']:.1f}", f"{row['itl_steady_p99_ms']:.1f}",
                      f"{row['itl_p99_over_p50']:.2f}x")
    Console(width=200).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
