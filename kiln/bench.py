"""`kiln bench`: measure a kiln engine in process or a served one over tritonclient gRPC.

Sends a prompt set (synthetic, with set input/output lengths, or a file of real prompts),
sweeps concurrency (closed loop) or a request rate (open loop, Poisson arrivals), and reports
output tokens/s, requests/s, TTFT, inter-token latency and end-to-end latency at P50/P90/P99,
and KV cache use (in process). A closed loop's TTFT and inter-token latency are also given for
its steady state: after the first wave (every client's first request, all sent at once). Writes
JSON and PNG plots; shows progress while it runs. An engine in process takes run-time options
(--runtime KEY=VALUE). Every request generates exactly its output length (the end id is set to
one no model emits)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

NEVER = -1  # an end id no model produces: every request runs to its max_tokens
PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values_s: list[float]) -> dict:
    """Milliseconds: p50/p90/p99 and mean of values given in seconds."""
    out = {f"p{q}": 1000 * percentile(values_s, q) for q in PERCENTILES}
    out["mean"] = 1000 * sum(values_s) / len(values_s) if values_s else float("nan")
    return out


# --- prompts ---------------------------------------------------------------------------------
def load_tokenizer(path: str | Path):
    """A tokenizer from an engine dir, a tokenizer/ dir or a tokenizer.json file."""
    from tokenizers import Tokenizer

    path = Path(path)
    for candidate in (path, path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return Tokenizer.from_file(str(candidate))
    raise FileNotFoundError(f"no tokenizer.json at {path} (give an engine dir or a tokenizer.json)")


def prose_ids(tokenizer, count: int, input_tokens: int, seed: int = 0) -> list[list[int]]:
    """Real prose (Python's own docs): `count` passages of exactly `input_tokens` token ids."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode(" ".join(topics.values())).ids
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - input_tokens) for _ in range(count)]
    return [ids[start : start + input_tokens] for start in starts]


def synthetic_prompts(tokenizer, count: int, input_tokens: int, seed: int = 0) -> list[str]:
    """Real prose (Python's own docs) cut to `input_tokens` tokens, a different passage each."""
    return [tokenizer.decode(ids) for ids in prose_ids(tokenizer, count, input_tokens, seed)]


def file_prompts(path: str | Path) -> list[str]:
    """One prompt per line (.txt), or a `text` field per line (.jsonl)."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in lines]
    return lines


# --- targets ---------------------------------------------------------------------------------
class EngineTarget:
    """The engine in this process (LLM.stream on the Executor)."""

    def __init__(self, engine_dir: str | Path, **runtime_overrides):
        from kiln.runtime.llm import LLM

        self.llm = LLM(engine_dir, **runtime_overrides)
        self.tokenizer = self.llm.tokenizer
        self.name = f"engine {engine_dir}"

    def stream(self, prompt: str, max_tokens: int) -> Iterator[int]:
        for chunk in self.llm.stream(prompt, max_tokens=max_tokens, end_id=NEVER):
            if chunk.token_ids:
                yield len(chunk.token_ids)

    def kv_stats(self) -> dict | None:
        return self.llm.stats()

    def close(self) -> None:
        self.llm.close()


class GrpcTarget:
    """A kiln (or TensorRT-LLM style) ensemble served by tritonserver, over gRPC streaming.
    A chunk's token count is not on the wire: chunks are counted, and the request's total is
    its max_tokens (no early stop)."""

    def __init__(self, url: str, model: str = "ensemble", metrics_url: str | None = None):
        self.url, self.model, self.metrics_url = url, model, metrics_url
        self.name = f"gRPC {url}/{model}"

    def stream(self, prompt: str, max_tokens: int) -> Iterator[int | None]:
        from kiln.triton_repo.client import stream_generate

        for _ in stream_generate(self.url, prompt, max_tokens, model=self.model, end_id=NEVER):
            yield None

    def kv_stats(self) -> dict | None:
        """The engine model's KV gauges from Triton's metrics endpoint (when given)."""
        if not self.metrics_url:
            return None
        import urllib.request

        from kiln import constants as names

        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        stats = {}
        for line in text.splitlines():
            for metric, key in ((names.METRIC_KV_BLOCKS, "blocks"), (names.METRIC_PREEMPTIONS, "preemptions"),
                                (names.METRIC_PREFIX_HIT_RATE, "prefix_hit_rate")):
                if line.startswith(metric + "{"):
                    labels, value = line[len(metric) + 1 :].rsplit("} ", 1)
                    state = dict(part.split("=", 1) for part in labels.split(",")).get("state", "").strip('"')
                    stats[f"blocks_{state}" if key == "blocks" else key] = float(value)
        if "blocks_total" not in stats:
            return None
        stats["blocks_used_peak"] = stats.pop("blocks_peak")
        return stats

    def close(self) -> None:
        pass


# --- measurement -----------------------------------------------------------------------------
@dataclass
class Record:
    submitted: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    finished: float = 0.0
    error: str | None = None


def measure(target, prompt: str, max_tokens: int) -> Record:
    record = Record(time.perf_counter())
    try:
        for count in target.stream(prompt, max_tokens):
            record.arrivals.append(time.perf_counter())
            record.tokens += count or 0
        if record.tokens == 0:  # counts not on the wire (gRPC): every request runs to max_tokens
            record.tokens = max_tokens if record.arrivals else 0
    except Exception as exc:  # a failed request is counted, not fatal to the run
        record.error = str(exc)
    record.finished = time.perf_counter()
    return record


class KVWatch:
    """KV block use over one level. In process: the engine's high-water mark, reset per level.
    Over gRPC (with --metrics-url): the served engine's gauges, polled while the level runs;
    its peak there counts since the server started."""

    def __init__(self, target):
        self.target = target
        self.sampled_max = 0.0
        self.stopping = threading.Event()
        self.poller = None
        if isinstance(target, EngineTarget):
            target.llm.executor.reset_peak_stats()
        elif target.kv_stats() is not None:
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()

    def _poll(self):
        while not self.stopping.wait(0.1):
            self.sampled_max = max(self.sampled_max, self.target.kv_stats()["blocks_used"])

    def summary(self) -> dict | None:
        self.stopping.set()
        if self.poller:
            self.poller.join()
        stats = self.target.kv_stats()
        if stats is None:
            return None
        used = max(stats["blocks_used_peak"] if self.poller is None else self.sampled_max, stats["blocks_used"])
        return {"blocks_total": stats["blocks_total"], "blocks_used_max": used,
                "blocks_used_peak_since_start": stats["blocks_used_peak"],
                "utilization_max": used / stats["blocks_total"],
                "preemptions": stats["preemptions"], "prefix_hit_rate": stats["prefix_hit_rate"]}


def summarize(records: list[Record], duration: float, **label) -> dict:
    ok = [r for r in records if r.error is None and r.arrivals]
    ttft = [r.arrivals[0] - r.submitted for r in ok]
    # inter-token latency: the gaps between a stream's consecutive responses (a response
    # carries one token unless it completes a character split over several)
    itl = [b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:])]
    tokens = sum(r.tokens for r in ok)
    return {
        **label,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "error_counts": {e: sum(r.error == e for r in records) for e in sorted({r.error for r in records if r.error})},
        "output_tokens": tokens,
        "duration_s": duration,
        "output_tokens_per_s": tokens / duration if duration else 0.0,
        "requests_per_s": len(ok) / duration if duration else 0.0,
        "ttft_ms": distribution(ttft),
        "itl_ms": distribution(itl),
        "e2e_ms": distribution([r.finished - r.submitted for r in ok]),
    }


class Collector:
    """Measures requests from many threads into one list."""

    def __init__(self, target, max_tokens: int, on_done: Callable[[], None]):
        self.target, self.max_tokens, self.on_done = target, max_tokens, on_done
        self.records: list[Record] = []
        self.lock = threading.Lock()

    def run(self, prompt: str) -> None:
        record = measure(self.target, prompt, self.max_tokens)
        with self.lock:
            self.records.append(record)
        self.on_done()


def run_concurrency(target, prompts: list[str], concurrency: int, max_tokens: int,
                    on_done: Callable[[], None] = lambda: None) -> dict:
    """Closed loop: `concurrency` clients, each sends its next request when the last ends."""
    pending = list(reversed(prompts))
    collector = Collector(target, max_tokens, on_done)

    def client():
        while True:
            with collector.lock:
                if not pending:
                    return
                prompt = pending.pop()
            collector.run(prompt)

    kv = KVWatch(target)
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    return {**summarize(collector.records, duration, mode="concurrency", concurrency=concurrency),
            "steady": steady_state(collector.records, concurrency), "kv_cache": kv.summary()}


def steady_state(records: list[Record], concurrency: int) -> dict:
    """A closed loop after its first wave (every client's first request, all sent at once, so
    a burst of prompts whatever the scheduler does): the later requests' TTFT and inter-token
    gaps."""
    later = sorted(records, key=lambda r: r.submitted)[concurrency:]
    ok = [r for r in later if r.error is None and r.arrivals]
    return {"requests": len(ok), "ttft_ms": distribution([r.arrivals[0] - r.submitted for r in ok]),
            "itl_ms": distribution([b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:])])}


def run_rate(target, prompts: list[str], rate: float, max_tokens: int, seed: int = 0,
             on_done: Callable[[], None] = lambda: None) -> dict:
    """Open loop: requests arrive as a Poisson process of `rate` requests per second."""
    rng = random.Random(seed)
    collector = Collector(target, max_tokens, on_done)

    kv = KVWatch(target)
    start = time.perf_counter()
    threads = []
    for prompt in prompts:
        thread = threading.Thread(target=collector.run, args=(prompt,))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    return {**summarize(collector.records, duration, mode="rate", request_rate=rate), "kv_cache": kv.summary()}


# --- reporting -------------------------------------------------------------------------------
def plot(results: list[dict], out_dir: Path) -> list[Path]:
    """throughput.png (tokens/s vs load) and latency.png (TTFT / ITL / end-to-end percentiles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    key = "concurrency" if results[0]["mode"] == "concurrency" else "request_rate"
    xs = [r[key] for r in results]
    label = "concurrent streams" if key == "concurrency" else "request rate (req/s)"
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["output_tokens_per_s"] for r in results], marker="o")
    ax.set(xlabel=label, ylabel="output tokens/s", title="Throughput")
    if key == "concurrency":
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (metric, title) in zip(axes, [("ttft_ms", "Time to first token"), ("itl_ms", "Inter-token latency"),
                                          ("e2e_ms", "End-to-end latency")]):
        for q in PERCENTILES:
            ax.plot(xs, [r[metric][f"p{q}"] for r in results], marker="o", label=f"p{q}")
        ax.set(xlabel=label, ylabel="ms", title=title)
        if key == "concurrency":
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def table(results: list[dict], title: str):
    from rich.table import Table

    key = "concurrency" if results[0]["mode"] == "concurrency" else "request_rate"
    t = Table(title=title)
    steady = key == "concurrency"
    for column in (key, "requests", "failed", "tok/s", "req/s", "TTFT p50", "TTFT p99", "ITL p50",
                   "ITL p99", *(("steady ITL p50", "steady ITL p99") if steady else ()), "E2E p50", "E2E p99",
                   "KV max"):
        t.add_column(column, justify="right")
    for r in results:
        kv = r.get("kv_cache")
        def ms(value: float, digits: int) -> str:  # "-" where no request succeeded
            return "-" if value != value else f"{value:.{digits}f}"

        t.add_row(str(r[key]), str(r["requests"]), str(r["failed"]), f"{r['output_tokens_per_s']:.1f}",
                  f"{r['requests_per_s']:.2f}", ms(r["ttft_ms"]["p50"], 0), ms(r["ttft_ms"]["p99"], 0),
                  ms(r["itl_ms"]["p50"], 1), ms(r["itl_ms"]["p99"], 1),
                  *((ms(r["steady"]["itl_ms"]["p50"], 1), ms(r["steady"]["itl_ms"]["p99"], 1)) if steady else ()),
                  ms(r["e2e_ms"]["p50"], 0),
                  ms(r["e2e_ms"]["p99"], 0), f"{100 * kv['utilization_max']:.0f}%" if kv else "-")
    return t


def machine() -> dict:
    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_avg": list(os.getloadavg()), "python": platform.python_version()}


def runtime_options(items: list[str]) -> dict:
    """KEY=VALUE items, each value JSON (max_prefill_share=0.125, kv_cache_memory='"4GiB"'), as
    run-time options for LLM(...); ValueError naming the item that is not one."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{key}: {value!r} is not a JSON value (strings in quotes: '\"4GiB\"')") from None
    return options


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    parser = argparse.ArgumentParser(prog="kiln bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="tritonserver gRPC HOST:PORT")
    where.add_argument("--engine", help="an engine dir, run in this process")
    parser.add_argument("--model", default="ensemble", help="model to call over gRPC")
    parser.add_argument("--metrics-url", default=None,
                        help="Triton's metrics HOST:PORT, to report the served engine's KV cache use")
    parser.add_argument("--tokenizer", default=None,
                        help="engine dir or tokenizer.json for synthetic prompts (default: --engine)")
    parser.add_argument("--prompts", default=None, help="a .txt (one per line) or .jsonl (text) prompt file")
    parser.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length")
    parser.add_argument("--output-tokens", type=int, default=64)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, nargs="+", default=None, help="sweep (default 1 4 16 64)")
    load.add_argument("--request-rate", type=float, nargs="+", default=None, help="requests/s sweep")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per level (default: 3 x concurrency, at least 8; 32 for rates)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (in process)")
    parser.add_argument("--runtime", nargs="+", default=[], metavar="KEY=VALUE",
                        help="in process: run-time options over the engine's, as JSON values "
                             "(max_prefill_share=0.125 prefill_per_decode=1.5); a server takes them at its start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write throughput.png, latency.png here")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        runtime = runtime_options(args.runtime)
    except ValueError as exc:
        parser.error(f"--runtime: {exc}")
    if runtime and args.url:
        parser.error("--runtime applies to an engine run in process; give a server its options when it starts "
                     "(kiln serve --max-prefill-share ...)")

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        target = EngineTarget(args.engine, **runtime) if args.engine else GrpcTarget(args.url, args.model,
                                                                                      args.metrics_url)
    except (TypeError, ValueError) as exc:  # an unknown run-time option, or a bad value
        if not runtime:
            raise
        parser.error(f"--runtime: {exc}")
    try:
        if args.prompts:
            base_prompts = file_prompts(args.prompts)
        else:
            source = args.tokenizer or args.engine
            if source is None:
                parser.error("synthetic prompts need --tokenizer (an engine dir or tokenizer.json) with --url")
            tokenizer = target.tokenizer if args.engine else load_tokenizer(source)
        levels = args.request_rate or args.concurrency or [1, 4, 16, 64]
        results = []
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            for level in levels:
                if args.request_rate:
                    count = args.requests or 32
                else:
                    count = args.requests or max(8, 3 * int(level))
                # each level its own passages (rates 1.0 and 1.6 too): the same prompts again would
                # hit the prefix cache the level before filled
                prompts = ([base_prompts[i % len(base_prompts)] for i in range(count)] if args.prompts
                           else synthetic_prompts(tokenizer, count, args.input_tokens,
                                                  args.seed + round(1000 * level)))
                task = progress.add_task(f"{'rate' if args.request_rate else 'concurrency'} {level}", total=count)
                advance = lambda: progress.advance(task)  # noqa: E731
                if args.request_rate:
                    results.append(run_rate(target, prompts, level, args.output_tokens, args.seed, advance))
                else:
                    results.append(run_concurrency(target, prompts, int(level), args.output_tokens, advance))
    finally:
        target.close()
    errors = {}  # each distinct error once, with how many requests it ended
    for r in results:
        for error, count in r["error_counts"].items():
            errors[error] = errors.get(error, 0) + count
    for error, count in errors.items():
        console.print(f"[red]{count} request{'s' * (count > 1)} failed:[/red] {error}")
    Console(width=160).print(table(results, f"kiln bench: {target.name}, input {args.input_tokens if not args.prompts else 'file'}, "
                                           f"output {args.output_tokens} tokens (latencies in ms)"))
    report = {"target": target.name, "input_tokens": None if args.prompts else args.input_tokens,
              "output_tokens": args.output_tokens, "prompts": args.prompts, "machine": machine(),
              "threads": args.threads, "runtime": runtime, "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {args.json}")
    if args.plot_dir:
        try:
            for path in plot(results, args.plot_dir):
                console.print(f"wrote {path}")
        except ImportError:
            console.print("plots need matplotlib: pip install 'kiln[bench]'")
    return 1 if any(r["failed"] for r in results) else 0
