"""Decode steps of many sequences at once, timed in process without the scheduler: B sequences
with `--cached` tokens each (prefilled into one pool, a block table each), then one-token steps of
all B together. Shows how a step's time grows with its rows (tok/s = B / step time) and, with
--profile B, where a B-row step's time goes (torch.profiler, ops by their own time).

    PYTHONPATH=. python benchmarks/ablations/batch_steps.py out/smollm2-int4-awq/engine \
        --rows 1 4 8 16 32 64 --threads 2 --json out/batch-steps.json
    PYTHONPATH=. python benchmarks/ablations/batch_steps.py out/smollm2-bf16/engine --rows 16 64 --prefill 128 512 \
        --batch-invariant off    # the tactics' routes instead of one route at every row count
    PYTHONPATH=. python benchmarks/ablations/batch_steps.py out/smollm2-int4-awq/engine --profile 16
    PYTHONPATH=. python benchmarks/ablations/batch_steps.py out/smollm2-int4-awq/engine --phases 16 --threads 1
    PYTHONPATH=. python benchmarks/ablations/batch_steps.py out/smollm2-int4-awq/engine --prefill-phases 4 --threads 2

--phases B splits a B-row step inside kiln::decode_layers by the library's step clock (linears,
attention, norms, activation; decode_profile.py --phases does so for one sequence);
--prefill-phases P does so for one step prefilling P prompts of --cached tokens together.

Prints medians of --rounds rounds and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_info  # noqa: E402


def batch_timer(engine, rows: int, cached: int, steps: int):
    """run(n) -> ms per step of `rows` sequences decoding together, over the next n <= steps
    positions (the same positions every call)."""
    from kiln.runtime.model import KVPool, StepContext

    model, block = engine.model, engine.limits.kv_block_size
    per_seq = -(-(cached + steps + 1) // block)
    pool = KVPool(engine.spec, rows * per_seq, block, model.kv_dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(rows)]
    prompt = torch.arange(100, 100 + cached)
    for table in tables:
        model.forward(prompt, StepContext.single(0, cached, table), pool)
    contexts = [StepContext(positions=torch.full((rows,), cached + i), query_start=torch.arange(rows + 1, dtype=torch.int32),
                            context_lens=torch.full((rows,), cached + i, dtype=torch.int32),
                            block_tables=torch.tensor(tables, dtype=torch.int32), logits_rows=torch.arange(rows))
                for i in range(steps)]
    tokens = torch.full((rows,), 5)

    def run(n: int = steps) -> float:
        start = time.perf_counter()
        for i in range(n):
            model.forward(tokens, contexts[i], pool)
        return (time.perf_counter() - start) / n * 1000

    run(4)  # warm up
    return run


def prefill_timer(engine, prompts: int, tokens: int):
    """run() -> ms of one step prefilling `prompts` prompts of `tokens` tokens each together (as
    the scheduler packs simultaneous arrivals into one step)."""
    from kiln.runtime.model import KVPool, StepContext

    model, block = engine.model, engine.limits.kv_block_size
    per_seq = -(-tokens // block)
    pool = KVPool(engine.spec, prompts * per_seq, block, model.kv_dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(prompts)]
    context = StepContext(positions=torch.arange(tokens).repeat(prompts),
                          query_start=torch.arange(0, prompts * tokens + 1, tokens, dtype=torch.int32),
                          context_lens=torch.zeros(prompts, dtype=torch.int32),
                          block_tables=torch.tensor(tables, dtype=torch.int32),
                          logits_rows=torch.arange(tokens - 1, prompts * tokens, tokens))
    ids = torch.arange(100, 100 + prompts * tokens) % engine.spec.vocab_size

    def run() -> float:
        start = time.perf_counter()
        model.forward(ids, context, pool)
        return (time.perf_counter() - start) * 1000

    run()  # warm up
    return run


def prefill_ms(engine, tokens: int, rounds: int) -> float:
    """The median time of one `tokens`-token prompt's prefill (a step of that many rows)."""
    run = prefill_timer(engine, 1, tokens)
    return statistics.median(run() for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--cached", type=int, default=128, help="tokens in each sequence before the timed steps")
    parser.add_argument("--steps", type=int, default=16, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-invariant", choices=["on", "off"], default="on",
                        help="on: the runtime's default routes (LlamaModel.make_batch_invariant); off: the tactics'")
    parser.add_argument("--profile", type=int, default=None, metavar="ROWS", help="profile a ROWS-row step instead")
    parser.add_argument("--phases", type=int, default=None, metavar="ROWS",
                        help="a ROWS-row step's phases inside decode_layers instead (the step clock)")
    parser.add_argument("--prefill-phases", type=int, default=None, metavar="PROMPTS",
                        help="a step prefilling PROMPTS prompts of --cached tokens together, its phases instead")
    parser.add_argument("--prefill", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="also time one prompt of each of these lengths (a step of that many rows)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from kiln.runtime.engine import Engine

    engine = Engine(args.engine)
    if args.batch_invariant == "on":
        engine.model.make_batch_invariant()
    if args.profile:
        from torch.profiler import profile

        torch.set_num_threads(args.threads[0])
        run = batch_timer(engine, args.profile, args.cached, args.steps)
        print(f"{args.profile} rows: {statistics.median(run() for _ in range(args.rounds)):.2f} ms a step")
        with profile() as prof:
            run()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return
    if args.phases or args.prefill_phases:
        from decode_profile import phase_rounds

        torch.set_num_threads(args.threads[0])
        if args.phases:
            timer, what = batch_timer(engine, args.phases, args.cached, args.steps), f"{args.phases} rows"
        else:
            timer = prefill_timer(engine, args.prefill_phases, args.cached)
            what = f"{args.prefill_phases} prompts of {args.cached} tokens prefilled together"
        rounds = phase_rounds(timer, args.rounds)
        print(f"{what}, {args.threads[0]} thread(s), ms a step (median of {args.rounds} rounds):")
        medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
        for name, ms in medians.items():
            print(f"  {name:>24}: {ms:8.2f}")
        if args.json:
            args.json.write_text(json.dumps({"host": host_info(), "command": " ".join(sys.argv), "engine": args.engine,
                                             "what": what, "threads": args.threads[0], "median_ms": medians,
                                             "rounds_ms": rounds}, indent=1))
        return
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            run = batch_timer(engine, rows, args.cached, args.steps)
            ms = statistics.median(run() for _ in range(args.rounds))
            results.append({"threads": threads, "rows": rows, "step_ms": ms, "tok_s": rows / ms * 1000})
            print(f"threads {threads} rows {rows:>3}: {ms:8.2f} ms a step, {rows / ms * 1000:8.1f} tok/s", flush=True)
        for tokens in args.prefill:
            ms = prefill_ms(engine, tokens, args.rounds)
            results.append({"threads": threads, "prefill_tokens": tokens, "prefill_ms": ms})
            print(f"threads {threads} prefill {tokens:>4}: {ms:8.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"host": host_info(), "command": " ".join(sys.argv), "engine": args.engine,
                                         "tactics": engine.tactics, "batch_invariant": args.batch_invariant,
                                         "cached": args.cached, "results": results}, indent=1))


if __name__ == "__main__":
    main()
