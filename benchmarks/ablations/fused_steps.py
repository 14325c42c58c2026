"""Every step in one plugin call (kiln::decode_layers at any row count: the runtime's default
where every linear takes its kernel at every row count) against steps of more than SKINNY_ROWS
rows in LlamaModel's Python layer loop (the runtime before), side by side. The two give the
same bits (tests/runtime/test_decode_layers.py); this measures what the loop's interpreter and
per-kernel thread forks cost.

1. Steps in process, without the scheduler: B sequences with --cached tokens each decode one
   token a step, alone and with a --chunk-token prefill chunk of a new prompt beside them (the
   steps the scheduler makes under load). Each round times the fused step, then the loop.
2. With --concurrency: kiln bench's closed loop in process, each arm in a fresh process of its
   own (the loop's arm capped to SKINNY_ROWS), taking turns, the same fresh prompts to each.

    PYTHONPATH=. python benchmarks/ablations/fused_steps.py out/smollm2-w4a8-awq/engine \
        --rows 16 64 --threads 2 1 --concurrency 16 64 --json out/fused-steps.json

Prints medians over the rounds and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_info  # noqa: E402

FUSED, LOOP = "fused", "loop above SKINNY_ROWS"


def step_runner(engine, rows: int, cached: int, chunk: int):
    """run() -> ms of one step: `rows` sequences with `cached` tokens decoding one token each, and
    beside them (chunk > 0) the first `chunk` tokens of a new prompt. The same step every call."""
    import torch

    from kiln.runtime.model import KVPool, StepContext

    model, block = engine.model, engine.limits.kv_block_size
    per_seq = -(-(max(cached + 1, chunk)) // block)
    pool = KVPool(engine.spec, (rows + 1) * per_seq, block, model.kv_dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(rows + 1)]
    prompt = torch.arange(100, 100 + cached)
    for table in tables[:rows]:
        model.forward(prompt, StepContext.single(0, cached, table), pool)
    new = [1] * rows + ([chunk] if chunk else [])
    lens = [cached] * rows + ([0] if chunk else [])
    starts = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    ctx = StepContext(positions=torch.cat([torch.arange(c, c + n) for c, n in zip(lens, new)]), query_start=starts,
                      context_lens=torch.tensor(lens, dtype=torch.int32),
                      block_tables=torch.tensor(tables[:len(new)], dtype=torch.int32), logits_rows=starts[1:].long() - 1)
    tokens = torch.full((sum(new),), 5)

    def run() -> float:
        start = time.perf_counter()
        model.forward(tokens, ctx, pool)
        return (time.perf_counter() - start) * 1000

    return run


def time_steps(engine, args) -> list[dict]:
    import torch

    from kiln.runtime.linear import SKINNY_ROWS

    model = engine.model
    fused_rows = model.fused_rows
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            for chunk in (0, args.chunk):
                run = step_runner(engine, rows, args.cached, chunk)
                times: dict[str, list[float]] = {FUSED: [], LOOP: []}
                for i in range(args.rounds + 1):  # the first warms up
                    for name, cap in ((FUSED, fused_rows), (LOOP, min(fused_rows, SKINNY_ROWS))):
                        model.fused_rows = cap
                        ms = statistics.median(run() for _ in range(args.steps))
                        if i:
                            times[name].append(ms)
                model.fused_rows = fused_rows
                row = {"threads": threads, "decode_rows": rows, "prefill_chunk": chunk,
                       **{f"{name}_ms": statistics.median(t) for name, t in times.items()}, "rounds": times}
                row["speedup"] = row[f"{LOOP}_ms"] / row[f"{FUSED}_ms"]
                results.append(row)
                print(f"threads {threads} decode rows {rows:>3} + chunk {chunk:>4}: fused {row[f'{FUSED}_ms']:8.2f} ms, "
                      f"loop {row[f'{LOOP}_ms']:8.2f} ms, {row['speedup']:.3f}x", flush=True)
    return results


def serve_one(engine: str, cap: bool, level: int, seed: int, args: dict) -> float:
    """One arm of the closed loop in a process of its own (a child: the engine alone in it, as
    kiln bench runs it), output tokens/s."""
    import torch

    torch.set_num_threads(args["threads"][0])
    from kiln.bench import EngineTarget, run_concurrency, synthetic_prompts
    from kiln.runtime.linear import SKINNY_ROWS

    target = EngineTarget(engine, enable_prefix_reuse=False)
    try:
        if cap:
            model = target.llm.engine.model
            model.fused_rows = min(model.fused_rows, SKINNY_ROWS)
        prompts = synthetic_prompts(target.tokenizer, args["waves"] * level, args["prompt_tokens"], seed=seed)
        result = run_concurrency(target, prompts, level, args["output_tokens"])
    finally:
        target.close()
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed: {result['errors']}")
    return result["output_tokens_per_s"]


def serve(args) -> list[dict]:
    """Each arm in a fresh process (spawned), the arms taking turns, the same prompts to both.
    With both engines in one process the loop arm read far slower (docs/benchmarks.md, "Every
    step in one call"; the cause not examined), so each arm runs alone, as kiln bench runs it."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    runs: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for level in args.concurrency:
            arms = [(FUSED, False), (LOOP, True)]
            for name, cap in (arms if r % 2 == 0 else arms[::-1]):
                with spawn.Pool(1) as pool:
                    tok_s = pool.apply(serve_one, (args.engine, cap, level, 1000 * r + level, vars(args)))
                runs.setdefault((level, name), []).append(tok_s)
                print(f"round {r + 1}, {level} streams, {name}: {tok_s:.1f} tok/s", flush=True)
    rows = []
    for level in args.concurrency:
        fused, loop = runs[level, FUSED], runs[level, LOOP]
        rows.append({"concurrency": level, "fused_tok_s": fused, "loop_tok_s": loop,
                     "ratios": [f / lo for f, lo in zip(fused, loop)]})
        print(f"{level} streams: fused {statistics.median(fused):.1f} tok/s, loop {statistics.median(loop):.1f}, "
              f"per round {' '.join(f'{x:.3f}x' for x in rows[-1]['ratios'])}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine")
    parser.add_argument("--rows", type=int, nargs="*", default=[16, 64], help="decoding sequences a step")
    parser.add_argument("--cached", type=int, default=128, help="tokens in each decoding sequence")
    parser.add_argument("--chunk", type=int, default=128, help="prefill tokens beside the decodes (0: none)")
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=5, help="steps a round (their median)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[], help="also kiln bench's closed loop")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=3, help="requests = this x concurrency")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads[0])  # (spawned children inherit it)
    steps = []
    if args.rows:
        from kiln.runtime.engine import Engine

        engine = Engine(args.engine)
        engine.model.make_batch_invariant()  # the runtime's default routes
        steps = time_steps(engine, args)
        del engine
    serving = serve(args) if args.concurrency else []
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host_info(), "command": " ".join(sys.argv), "steps": steps,
                                         "serving": serving}, indent=1))


if __name__ == "__main__":
    main()
