"""`kiln serve REPO` (the real tritonserver) and `kiln generate --url HOST:PORT PROMPT`."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kiln.errors import KilnError


def _size_or_fraction(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def _seconds(text: str) -> float:
    value = float(text)
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _true_false(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _serve(args) -> int:
    from kiln.triton_repo.serve import TritonServer

    runtime = {"kv_cache_memory": args.kv_cache_memory, "max_queue_size": args.max_queue_size,
               "scheduler": args.scheduler, "enable_prefix_reuse": args.enable_prefix_reuse,
               "request_timeout": args.request_timeout, "batch_invariant": args.batch_invariant,
               "max_prefill_share": args.max_prefill_share, "kv_cache_reserve": args.kv_cache_reserve,
               "prefill_per_decode": args.prefill_per_decode, "prefill_max_wait": args.prefill_max_wait,
               "prefill_per_decode_from": args.prefill_per_decode_from, "stream_interval": args.stream_interval,
               "step_log": str(Path(args.step_log).resolve()) if args.step_log else None}
    server = TritonServer(args.repo, args.grpc_port, args.http_port, args.metrics_port, args.log_file, args.address,
                          {key: value for key, value in runtime.items() if value is not None})
    openai = None
    if args.openai_port is not None:  # fail on a bad repository or a taken port before starting Triton
        from kiln.triton_repo.openai_engine import ServedModel
        from kiln.triton_repo.openai_server import OpenAIServer

        openai = OpenAIServer(ServedModel.from_repo(args.repo, args.served_model_name), server.grpc_url,
                              args.address, args.openai_port)
    # SIGTERM stops it like Ctrl-C, from before the server starts: a supervisor that gives up on a
    # slow start must not leave a tritonserver behind. The handler only asks (request_stop):
    # start() and watch() look between their steps, so the signal never lands inside starting
    # the process (which would leave it running unrecorded) or a client's request.
    def interrupt(signum, frame):
        server.request_stop()

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    print(f"starting tritonserver on {args.repo} ...", file=sys.stderr, flush=True)
    try:
        server.start(args.timeout)
        if openai is not None and not server.stop_requested.is_set():
            openai.start()
    except BaseException:
        if not server.stop_requested.is_set():  # (a requested stop is below)
            if openai is not None:
                openai.stop()
            server.stop()  # (start() has stopped it where it failed; the OpenAI frontend's failure is after)
            raise
    if server.stop_requested.is_set():  # before 'ready:' (start() may have stopped the server already)
        if openai is not None:
            openai.stop()
        server.stop()
        print("kiln serve: stopped before the server was ready", file=sys.stderr)
        return 130
    extra = f"  OpenAI {openai.url}" if openai is not None else ""
    print(f"ready: gRPC {server.grpc_url}  HTTP {server.http_url}  metrics {server.address}:{server.metrics_port}"
          f"{extra}", file=sys.stderr, flush=True)
    try:
        problem = server.watch(frontend=openai)
    finally:
        if openai is not None:
            openai.stop()
    if problem is None:
        server.stop()
        return 0
    # a dead backend process leaves Triton answering "ready" while its requests hang: stop the whole
    # server at once (it cannot shut down cleanly without that process), so its clients get errors
    # now and a supervisor can start it again
    server.stop(timeout=1)
    print(f"error: {problem}\nkiln serve stopped the server (exit code 3); start it again", file=sys.stderr)
    return 3


def _openai(args) -> int:
    from kiln.triton_repo.client import connect
    from kiln.triton_repo.openai_engine import ServedModel
    from kiln.triton_repo.openai_server import OpenAIServer

    served = ServedModel.from_repo(args.repo, args.served_model_name)
    connect(args.url).close()  # says clearly when nothing serves there
    frontend = OpenAIServer(served, args.url, args.host, args.port).start()
    print(f"ready: OpenAI {frontend.url} (model {served.name!r}) -> Triton gRPC {args.url}", file=sys.stderr,
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        frontend.thread.join()
    except KeyboardInterrupt:
        pass
    frontend.stop()
    return 0


def _generate(args) -> int:
    from kiln.triton_repo.client import stream_generate

    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    for text in stream_generate(args.url, args.prompt, args.max_tokens, model=args.model,
                                **{k: v for k, v in sampling.items() if v is not None}):
        print(text, end="", flush=True)
    print()
    return 0


def _export(args) -> int:
    from kiln.builder.export import export_checkpoint

    out = export_checkpoint(Path(args.engine), Path(args.output))
    print(f"TensorRT-LLM checkpoint {out} (config.json, rank0.safetensors, tokenizer files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["eval"]):  # their own parsers: kiln bench --help, kiln eval --help
        if argv[0] == "bench":
            from kiln.bench import main as command
        else:
            from kiln.eval import main as command
        try:
            return command(argv[1:])
        except KilnError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="kiln", description="Serve kiln engines and talk to them.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start tritonserver on a kiln model repository")
    serve.add_argument("repo", help="the triton_repo/ folder build-engine wrote")
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--log-file", default=None,
                       help="tritonserver's log (default: a temporary file, kept when the server fails)")
    serve.add_argument("--address", default="127.0.0.1",
                       help="the interface to listen on (default loopback only; 0.0.0.0 for every interface)")
    serve.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    serve.add_argument("--openai-port", type=int, default=None,
                       help="also serve the OpenAI API (/v1/completions, /v1/chat/completions) on this port")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id OpenAI clients send (default: the build output folder's name)")
    runtime = serve.add_argument_group("run-time options (default: the engine's build config)")
    runtime.add_argument("--kv-cache-memory", default=None, type=_size_or_fraction,
                         help="the KV block pool: bytes ('4GiB') or a fraction of the memory available once "
                              "the weights are loaded ('0.5')")
    runtime.add_argument("--kv-cache-reserve", type=_true_false, default=None, metavar="true|false",
                         help="true: write the whole KV pool at load (memory as under load from the start); "
                              "false: pages become resident as sequences first use them")
    runtime.add_argument("--max-queue-size", type=int, default=None, help="waiting requests before 'busy'")
    runtime.add_argument("--scheduler", choices=["max_utilization", "guaranteed_no_evict"], default=None)
    runtime.add_argument("--enable-prefix-reuse", type=_true_false, default=None,
                         metavar="true|false")
    runtime.add_argument("--max-prefill-share", type=float, default=None, metavar="SHARE",
                         help="of max_num_tokens, what prefill chunks may take in a step that also decodes "
                              "(0, 1]: lower trades time to first token for inter-token latency")
    runtime.add_argument("--prefill-per-decode", type=float, default=None, metavar="TOKENS",
                         help="at most this many prefill tokens per decoding stream in a step (at least 16, at most "
                              "the share), from --prefill-per-decode-from decoding streams on: a lower inter-token p99 "
                              "for a later first token; 0: off")
    runtime.add_argument("--prefill-max-wait", type=float, default=None, metavar="SECONDS",
                         help="with --prefill-per-decode: how long the oldest prompt may wait before prefill takes "
                              "its whole share again")
    runtime.add_argument("--prefill-per-decode-from", type=_positive_int, default=None, metavar="STREAMS",
                         help="with --prefill-per-decode: the decoding streams from which it applies (below: the "
                              "share; default 8)")
    runtime.add_argument("--batch-invariant", type=_true_false, default=None,
                         metavar="true|false",
                         help="true: a request's tokens are the same bits whatever else runs (each linear one "
                              "route at every batch size); false: the tactics' fastest route per batch size")
    runtime.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                         help="end a request this long after it arrived, with what it generated (finish reason "
                              "'timeout'): bounds what a client that went away unnoticed costs; 0: never")
    runtime.add_argument("--stream-interval", type=_positive_int, default=None, metavar="TOKENS",
                         help="generated tokens a streaming response carries (the first alone, at once): fewer "
                              "responses for Triton and the clients to pass on, in bursts of TOKENS; default 1")
    runtime.add_argument("--step-log", default=None, metavar="FILE",
                         help="append a JSON line per engine step to FILE (its time, model ms, sequences, prefill "
                              "and decode tokens, queue, KV blocks: docs/engine.md)")
    serve.set_defaults(run=_serve)

    openai = sub.add_parser("openai", help="serve the OpenAI API for a running tritonserver (docs/openai.md)")
    openai.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC HOST:PORT serving REPO")
    openai.add_argument("--repo", required=True,
                        help="the triton_repo/ folder it serves (the frontend reads the engine's tokenizer, "
                             "chat template and limits from it)")
    openai.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    openai.add_argument("--port", type=int, default=9000)
    openai.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: the build output folder's name)")
    openai.set_defaults(run=_openai)

    gen = sub.add_parser("generate", help="stream a completion over gRPC (tritonclient)")
    gen.add_argument("prompt")
    gen.add_argument("--url", default="127.0.0.1:8001", help="tritonserver gRPC HOST:PORT")
    gen.add_argument("--model", default="ensemble")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(run=_generate)

    export = sub.add_parser("export", help="write an engine as a TensorRT-LLM checkpoint")
    export.add_argument("--engine", required=True, help="the engine/ folder build-engine wrote")
    export.add_argument("--format", choices=["tensorrt_llm"], default="tensorrt_llm")
    export.add_argument("--output", required=True, help="the checkpoint folder to write")
    export.set_defaults(run=_export)

    sub.add_parser("bench", help="benchmark an engine or a server (kiln bench --help)")
    sub.add_parser("eval", help="perplexity of an engine on a text file (kiln eval --help)")

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
