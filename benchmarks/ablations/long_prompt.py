"""A long prompt arriving among decoding streams, in process: its time to first token, and the
streams' inter-token times while it is prefilled, for each prefill budget beside decodes
(runtime.max_prefill_share; prefill_per_decode and prefill_max_wait). The trade-off it sets: a
small budget keeps the streams' steps short, a large one gets the long prompt's first token out
sooner.

Each round (one thread enqueues and takes every response, as the Triton model does): --streams
requests of --stream-prompt tokens start together and decode (greedy, no early stop); once every
one has --warm tokens, one request of --long-tokens prompt tokens arrives. Measured: that
request's time to first token (and the same request's alone, no streams, for scale), the
streams' inter-token times inside that window (p50, p99, max), and outside it (after the
warm-up, p50).

    PYTHONPATH=. python benchmarks/ablations/long_prompt.py out/smollm2-int4-awq/engine \
        --settings max_prefill_share=0.25 max_prefill_share=0.0625 --streams 16 --long-tokens 1000 \
        --rounds 3 --json out/long-prompt.json

Prompts are real prose (Python's pydoc topics, kiln.bench.prose_ids), a different passage each;
percentiles as kiln bench takes them. Prints medians over the rounds and writes JSON. No timing
is asserted anywhere."""
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


def run_requests(executor, prompts: list[list[int]], max_tokens: int, arrive_after=None) -> dict[int, list[float]]:
    """Enqueue `prompts` and take every response on this one thread, as the Triton model does
    (triton_repo/engine_model.py): {request id: the arrival time of each of its tokens}.
    arrive_after = (warm, prompt, tokens): once every request has `warm` tokens, `prompt` is
    enqueued too (its id is the largest)."""
    from kiln.bench import NEVER
    from kiln.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, end_id=NEVER)
    times = {executor.enqueue(p, params): [] for p in prompts}
    live = set(times)
    while live:
        for response in executor.await_responses(timeout=1.0):
            now = time.perf_counter()
            if response.error:
                raise RuntimeError(response.error)
            times[response.request_id] += [now] * len(response.token_ids)
            if response.finished:
                live.discard(response.request_id)
        if arrive_after and all(len(t) >= arrive_after[0] for t in times.values()):
            _, prompt, tokens = arrive_after
            arrive_after = None
            late = executor.enqueue(prompt, SamplingParams(max_tokens=tokens, end_id=NEVER))
            times[late], live = [time.perf_counter()], live | {late}  # [its submission, its tokens...]
    return times


def first_token_ms(executor, prompt: list[int]) -> float:
    start = time.perf_counter()
    (times,) = run_requests(executor, [prompt], 1).values()
    return 1000 * (times[0] - start)


def one_round(executor, streams: list[list[int]], long_prompt: list[int], stream_tokens: int, warm: int) -> dict:
    """The long prompt's time to first token among the decoding streams, and the streams'
    inter-token gaps inside and outside that window (ms)."""
    times = run_requests(executor, streams, stream_tokens, (warm, long_prompt, 1))
    late = max(times)
    submitted, first = times.pop(late)
    inside, outside, covered = [], [], True
    for arrivals in times.values():
        if arrivals[-1] < first:
            covered = False  # a stream ended before the long prompt's first token
        for a, b in zip(arrivals[warm:], arrivals[warm + 1:]):
            # a gap belongs to the window when it ends inside it or spans its end
            (inside if b > submitted and a < first else outside).append(1000 * (b - a))
    return {"long_ttft_ms": 1000 * (first - submitted), "itl_inside": inside, "itl_outside": outside,
            "covered": covered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine")
    parser.add_argument("--settings", nargs="+", default=["max_prefill_share=0.25", "max_prefill_share=0.0625"],
                        metavar="KEY=VALUE,...",
                        help="run-time options to compare, each a comma-separated list (JSON values)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-prompt", type=int, default=128)
    parser.add_argument("--stream-tokens", type=int, default=160, help="each stream's output (covers the window)")
    parser.add_argument("--warm", type=int, default=8, help="stream tokens before the long prompt arrives")
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    from kiln.bench import percentile, prose_ids, runtime_options
    from kiln.runtime.llm import LLM

    console = Console(stderr=True)
    rows = []
    for setting in args.settings:
        options = runtime_options(setting.split(","))
        # no prefix reuse: the long prompt runs alone first, and among the streams it must be prefilled again
        with LLM(args.engine, **options, enable_prefix_reuse=False) as llm:
            budget = llm.executor.scheduler.prefill_limit(args.streams)  # before the wait limit, if any
            alone, rounds = [], []
            for r in range(args.rounds):
                seed = 1000 * r
                streams = prose_ids(llm.tokenizer, args.streams, args.stream_prompt, seed)
                (long_prompt,) = prose_ids(llm.tokenizer, 1, args.long_tokens, seed + 1)
                console.print(f"{setting} ({budget} prefill rows beside {args.streams} decodes), round {r + 1} ...")
                alone.append(first_token_ms(llm.executor, long_prompt))
                rounds.append(one_round(llm.executor, streams, long_prompt, args.stream_tokens, args.warm))
        ttft = statistics.median(x["long_ttft_ms"] for x in rounds)
        row = {
            "setting": setting, "prefill_rows": budget,
            "long_ttft_ms": ttft, "long_ttft_alone_ms": statistics.median(alone),
            "long_ttft_rounds_ms": [x["long_ttft_ms"] for x in rounds],
            "itl_inside_p50_ms": statistics.median(percentile(x["itl_inside"], 50) for x in rounds),
            "itl_inside_p99_ms": statistics.median(percentile(x["itl_inside"], 99) for x in rounds),
            "itl_inside_max_ms": statistics.median(max(x["itl_inside"]) for x in rounds),
            "itl_outside_p50_ms": statistics.median(percentile(x["itl_outside"], 50) for x in rounds),
            "windows_covered": all(x["covered"] for x in rounds),
        }
        rows.append(row)

    table = Table(title=f"a {args.long_tokens}-token prompt among {args.streams} decoding streams "
                        f"({args.threads} threads, medians of {args.rounds} rounds, ms)")
    for column in ("setting", "prefill rows", "long TTFT", "alone", "x alone", "stream ITL p50 (window)",
                   "p99 (window)", "max (window)", "ITL p50 (outside)", "p99 / p50 outside"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["setting"], str(r["prefill_rows"]), f"{r['long_ttft_ms']:.0f}",
                      f"{r['long_ttft_alone_ms']:.0f}", f"{r['long_ttft_ms'] / r['long_ttft_alone_ms']:.2f}",
                      f"{r['itl_inside_p50_ms']:.1f}", f"{r['itl_inside_p99_ms']:.1f}",
                      f"{r['itl_inside_max_ms']:.1f}", f"{r['itl_outside_p50_ms']:.1f}",
                      f"{r['itl_inside_p99_ms'] / r['itl_outside_p50_ms']:.2f}"
                      + ("" if r["windows_covered"] else " (window not covered)"))
    Console(width=200).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host_info(), "command": " ".join(sys.argv), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
