"""The served repository under load and faults, in the real tritonserver, measured.

    python benchmarks/serving_faults.py out/smollm2-bf16/triton_repo --minutes 10 --streams 64 \
        --json out/serving-faults.json

load      `--streams` clients for `--minutes`, each sending streamed gRPC requests one after another,
          alternating the ensemble and the BLS model; `--cancel` of them cancel mid-stream or drop
          the connection. Every request must end with a final response or an error: one that does
          not within `--request-timeout` is counted lost. Afterwards the engine's requests and KV
          blocks must drain (the Triton gauges), and the server processes' memory (RSS) is sampled
          from warm-up to the end.
overload  with `--queue-size` waiting requests allowed (kiln serve --max-queue-size), a burst of
          requests larger than that: the surplus must be refused at once ('busy', UNAVAILABLE), and a
          request right after must succeed.
faults    a request with NaN sampling values beside healthy ones (they must finish); then the
          engine model's process killed with streams in flight: they must get errors within 5 s
          and the server must be stopped (as `kiln serve` does).

Prints the figures and writes JSON; asserts nothing (the tests in tests/e2e do)."""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path


from host import host_info
from kiln.triton_repo.client import cancel_stream, ensemble_inputs
from kiln.triton_repo.serve import TritonServer, group_members

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash table works.",
           "List five uses of copper and say why.", "Describe the water cycle to a child.",
           "What makes a good API? Answer in a paragraph.", "Translate 'good morning' into four languages."]


def gauges(server: TritonServer) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("kiln_requests{", "kiln_kv_cache_blocks{")):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] + "." + name.split('state="')[1].split('"')[0]] = float(value)
    return out


def rss_mb(server: TritonServer) -> dict[str, float]:
    """Resident memory (MB) of each of the server's processes (tritonserver and one Python
    backend stub per model), and their total."""
    names = {server.process.pid: "tritonserver", **server.stubs}
    out: dict[str, float] = {}
    for pid in group_members(server.process.pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    name = names.get(pid, "other")
                    out[name] = out.get(name, 0.0) + int(line.split()[1]) / 1024
        except OSError:
            pass
    out = {f"rss_mb.{name}": round(mb, 1) for name, mb in sorted(out.items())}
    return {"rss_mb": round(sum(out.values()), 1), **out}


def one_request(server: TritonServer, model: str, rng: random.Random, cancel: float, timeout: float,
                max_tokens: int | None = None, **options) -> str:
    """One streamed request; its outcome: completed, error:<message>, cancelled, dropped, or lost."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    how = rng.choices(["cancel", "drop", None], [cancel / 2, cancel / 2, 1 - cancel])[0]
    stop_after = rng.randint(1, 8)
    inputs = ensemble_inputs(rng.choice(PROMPTS), max_tokens or rng.randint(16, 96), True, **options)
    client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    seen, outcome = 0, "lost"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                result, error = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if error is not None:
                outcome = f"error:{error.message() if hasattr(error, 'message') else error}"
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                outcome = "completed"
                break
            seen += 1
            if how and seen >= stop_after:
                outcome = "cancelled" if how == "cancel" else "dropped"
                break
    finally:
        if outcome == "dropped":
            client.close()  # the connection goes away without a word
        else:
            if outcome == "completed":
                client.stop_stream()
            else:
                cancel_stream(client)
            client.close()
    return outcome


def load(server: TritonServer, streams: int, seconds: float, cancel: float, timeout: float, seed: int) -> dict:
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds
    samples = []

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < end:
            model = "ensemble" if rng.random() < 0.5 else server_bls
            outcome = one_request(server, model, rng, cancel, timeout)
            with lock:
                outcomes.append((model, outcome))

    server_bls = next(p.name for p in server.repo.iterdir() if p.name.endswith("_bls"))
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    start = time.monotonic()
    while any(t.is_alive() for t in threads):
        samples.append({"t": round(time.monotonic() - start, 1), **rss_mb(server), **gauges(server)})
        time.sleep(5)
    drained_after = None
    for waited in range(120):  # the engine's requests and blocks must come back
        g = gauges(server)
        if g.get("kiln_requests.running", 1) == 0 and g.get("kiln_kv_cache_blocks.used", 1) == 0:
            drained_after = waited
            break
        time.sleep(1)
    samples.append({"t": round(time.monotonic() - start, 1), **rss_mb(server), **gauges(server)})
    counts: dict[str, dict[str, int]] = {}
    errors: dict[str, int] = {}
    for model, outcome in outcomes:
        kind = outcome.split(":", 1)[0]
        counts.setdefault(model, {}).setdefault(kind, 0)
        counts[model][kind] += 1
        if kind == "error":
            errors[outcome[6:][:160]] = errors.get(outcome[6:][:160], 0) + 1
    warm_samples = [s for s in samples if s["t"] >= min(60, seconds / 3)] or samples[-1:]
    warm = [s["rss_mb"] for s in warm_samples]
    by_process = {key[len("rss_mb."):]: [warm_samples[0].get(key), warm_samples[-1].get(key)]
                  for key in warm_samples[-1] if key.startswith("rss_mb.")}
    return {"streams": streams, "seconds": seconds, "cancel_share": cancel, "requests": len(outcomes),
            "by_model": counts, "errors": errors, "lost": sum(o == "lost" for _, o in outcomes),
            "drained_after_s": drained_after, "end": samples[-1],
            "rss_mb_after_warmup": {"first": warm[0], "last": warm[-1], "max": max(warm)},
            "rss_mb_by_process_after_warmup": by_process, "samples": samples}


def overload(server: TritonServer, queue_size: int, burst: int) -> dict:
    """`burst` requests at once against a queue of `queue_size`: how many are refused, how fast."""
    import tritonclient.grpc as grpcclient

    outcomes, lock = [], threading.Lock()

    def request() -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        started = time.monotonic()
        client.async_stream_infer("ensemble", ensemble_inputs(PROMPTS[0], 48, True), request_id=uuid.uuid4().hex,
                                  enable_empty_final_response=True)
        outcome = "lost"
        while True:
            try:
                result, error = results.get(timeout=300)
            except queue.Empty:
                break
            if error is not None:
                outcome = "refused (busy)" if "busy" in str(error) else f"error: {str(error)[:120]}"
                break
            if result.get_response().parameters["triton_final_response"].bool_param:
                outcome = "completed"
                break
        client.stop_stream()
        client.close()
        with lock:
            outcomes.append((outcome, time.monotonic() - started))

    threads = [threading.Thread(target=request) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [s for o, s in outcomes if o.startswith("refused")]  # seconds from sending to the refusal
    after = one_request(server, "ensemble", random.Random(0), 0.0, 120)
    return {"queue_size": queue_size, "burst": burst,
            "outcomes": {o: sum(x == o for x, _ in outcomes) for o in sorted({o for o, _ in outcomes})},
            "refused_within_s_max": max(refused) if refused else None, "request_after": after}


def faults(server: TritonServer) -> dict:
    rng = random.Random(7)
    healthy: list[str] = []
    threads = [threading.Thread(target=lambda: healthy.append(one_request(server, "ensemble", rng, 0.0, 120)))
               for _ in range(3)]
    for t in threads:
        t.start()
    bad = one_request(server, "ensemble", rng, 0.0, 120, temperature=1.0, presence_penalty=float("nan"))
    for t in threads:
        t.join()
    # the engine model's process killed with streams in flight
    inflight: list[str] = []
    killed_at = [0.0]

    def stream() -> None:  # long enough to be in flight when the process dies
        outcome = one_request(server, "ensemble", random.Random(), 0.0, 60, max_tokens=1000, end_id=-1)
        inflight.append((outcome, time.monotonic() - killed_at[0]))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(3)
    engine_pid = next(pid for pid, model in server.stubs.items() if model not in ("preprocessing", "postprocessing")
                      and not model.endswith("_bls"))
    os.kill(engine_pid, signal.SIGKILL)
    killed_at[0] = time.monotonic()
    problem = server.watch(interval=0.2)
    noticed = time.monotonic() - killed_at[0]
    server.stop(timeout=1)  # as kiln serve does
    for t in threads:
        t.join(timeout=60)
    return {"nan_request": bad[:200], "healthy_beside_it": healthy, "stub_death_noticed_s": round(noticed, 2),
            "problem": problem, "inflight_after_kill": [(o[:120], round(s, 2)) for o, s in inflight]}


def plot_load(report: dict, path: Path) -> None:
    """Memory of each server process and the engine's running requests / KV blocks over the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["load"]["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, (memory, engine) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for key in sorted({k for s in samples for k in s if k.startswith("rss_mb.")}):
        memory.plot(t, [s.get(key) for s in samples], label=key[len("rss_mb."):])
    memory.plot(t, [s["rss_mb"] for s in samples], "k--", label="all")
    memory.set_ylabel("resident memory (MB)")
    memory.legend(fontsize=8)
    engine.plot(t, [s.get("kiln_requests.running") for s in samples], label="running requests")
    engine.plot(t, [s.get("kiln_kv_cache_blocks.used") for s in samples], label="KV blocks used")
    engine.set_xlabel("minutes")
    engine.legend(fontsize=8)
    load = report["load"]
    fig.suptitle(f"{load['streams']} streams, {load['cancel_share']:.0%} cancelled or dropped: "
                 f"{load['requests']} requests, {load['lost']} lost\n{report['host'].get('cpu', '')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", type=Path, nargs="?", help="the Triton repository (not with --from-json)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--cancel", type=float, default=0.25, help="share of requests cancelled or dropped")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--queue-size", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="the load's KV budget (kiln serve --kv-cache-memory): the prefix cache fills "
                             "it, so the engine's memory grows until it is all in use")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of memory and engine load over time")
    parser.add_argument("--from-json", type=Path, default=None, help="plot an earlier run's JSON; run nothing")
    args = parser.parse_args()
    if args.from_json:
        plot_load(json.loads(args.from_json.read_text()), args.plot or args.from_json.with_suffix(".png"))
        return
    if args.repo is None:
        parser.error("the Triton repository to serve is required")

    report = {"host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    runtime = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
    with TritonServer(args.repo, runtime=runtime) as server:
        print(f"load: {args.streams} streams for {args.minutes} min ...", file=sys.stderr, flush=True)
        report["load"] = load(server, args.streams, args.minutes * 60, args.cancel, args.request_timeout, args.seed)
        print(json.dumps({k: v for k, v in report["load"].items() if k != "samples"}, indent=1), flush=True)
    with TritonServer(args.repo, runtime={"max_queue_size": args.queue_size}) as server:
        report["overload"] = overload(server, args.queue_size, 4 * args.queue_size + 16)
        print(json.dumps(report["overload"], indent=1), flush=True)
        report["faults"] = faults(server)
        print(json.dumps(report["faults"], indent=1), flush=True)
    report["processes_left"] = group_members(server.process.pid)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot_load(report, args.plot)


if __name__ == "__main__":
    main()
