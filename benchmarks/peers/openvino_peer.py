"""OpenVINO GenAI as a peer: SmolLM2 exported with optimum-intel at fp16 / int8 / int4 weights,
batch-1 decode timed with openvino_genai.LLMPipeline. Runs in its own environment
(benchmarks/peers/setup_openvino.sh makes .venv-openvino: optimum-intel pins its own
transformers), so it imports nothing of kiln; benchmarks/peers/run.py --openvino calls it and
puts its rows beside kiln's and llama.cpp's.

    .venv-openvino/bin/python benchmarks/peers/openvino_peer.py export --gguf PATH --out out/peers/openvino
    .venv-openvino/bin/python benchmarks/peers/openvino_peer.py time --model out/peers/openvino/int4 \
        --threads 1 --prompt-tokens 128 --decode-tokens 64 --repeats 3

export  the GGUF dequantized by transformers into a Hugging Face folder, then `optimum-cli export
        openvino` at each weight format: fp16; int8 (per channel); int4 (symmetric, group 32, every
        linear in int4: --ratio 1.0; the embedding / lm_head stays int8 as optimum-intel keeps it)
time    greedy decode of synthetic prompts like run.py's (another one each run: OpenVINO GenAI
        reuses the KV cache of an identical previous prompt), `--decode-tokens` forced
        (min_new_tokens), on `--threads` inference threads (`--precision` sets OpenVINO's inference
        precision; by default it picks, bf16 where the CPU has it); prints one JSON line: prefill_ms
        (OpenVINO's time to first token) and decode_tok_s (1000 / its time per output token),
        medians over the repeats after one warm-up, and the model's weight bytes on disk.
parallel  `--streams` prompts given at once to OpenVINO GenAI's ContinuousBatchingPipeline (paged
        KV cache, prompts split into chunks of max_num_batched_tokens fused with decodes, no
        prefix caching), each decoding `--decode-tokens` greedy tokens; prints one JSON line:
        output tokens/s over the whole run, prefill included, after one warm-up request."""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

FORMATS = {"fp16": ["--weight-format", "fp16"],
           "int8": ["--weight-format", "int8"],
           "int4": ["--weight-format", "int4", "--sym", "--group-size", "32", "--ratio", "1.0"]}


def export(gguf: Path, out: Path, formats: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = out / "hf"
    if not (hf / "config.json").exists():
        print(f"dequantizing {gguf.name} into {hf}", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    for kind in formats:
        target = out / kind
        if (target / "openvino_model.xml").exists():
            continue
        print(f"exporting {kind} into {target}", file=sys.stderr)
        shutil.rmtree(target, ignore_errors=True)
        cli = Path(sys.executable).with_name("optimum-cli")
        subprocess.run([str(cli), "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
                        *FORMATS[kind], str(target)], check=True)


def cpu_options(threads: int, precision: str | None) -> dict:
    options = {"INFERENCE_NUM_THREADS": threads}
    if precision:
        options["INFERENCE_PRECISION_HINT"] = precision
    return options


def greedy(decode_tokens: int):
    """Exactly `decode_tokens` greedy tokens."""
    import openvino_genai as genai

    config = genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = decode_tokens
    config.do_sample = False
    return config


def weight_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("openvino_model.bin"))


def time_decode(model: Path, threads: int, prompt_tokens: int, decode_tokens: int, repeats: int,
                precision: str | None) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    pipe = genai.LLMPipeline(str(model), "CPU", **cpu_options(threads, precision), PERFORMANCE_HINT="LATENCY")
    config = greedy(decode_tokens)
    prefill, rates = [], []
    for r in range(repeats + 1):  # the first run warms up
        # a prompt of its own each run: the pipeline keeps the previous prompt's KV cache and,
        # given the same prompt again, skips its prefill (time to first token ~40 ms instead
        # of ~500 ms for SmolLM2's 128 tokens on one AVX2 core)
        prompt = [(i * 7919 + r * 104729) % 40000 + 100 for i in range(prompt_tokens)]
        ids = np.array([prompt], dtype=np.int64)
        inputs = genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        result = pipe.generate(inputs, config)
        metrics = result.perf_metrics
        produced = len(result.tokens[0])
        if produced != decode_tokens:
            raise RuntimeError(f"OpenVINO produced {produced} tokens, not {decode_tokens}")
        if r:
            prefill.append(metrics.get_ttft().mean)
            rates.append(1000.0 / metrics.get_tpot().mean)
    return {"prefill_ms": statistics.median(prefill), "decode_tok_s": statistics.median(rates),
            "weight_bytes": weight_bytes(model), "precision": precision or "default", "openvino_genai": genai.__version__}


def time_parallel(model: Path, threads: int, streams: int, prompt_tokens: int, decode_tokens: int,
                  batched_tokens: int, precision: str | None) -> dict:
    import time

    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    scheduler = genai.SchedulerConfig()
    scheduler.max_num_batched_tokens = batched_tokens
    scheduler.max_num_seqs = max(streams, 1)
    scheduler.cache_size = 1  # GB of KV cache: 64 streams of 192 tokens need ~0.3
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = False
    pipe = genai.ContinuousBatchingPipeline(str(model), scheduler, "CPU", cpu_options(threads, precision))
    config = greedy(decode_tokens)

    def prompts(count: int, salt: int) -> list:
        return [ov.Tensor(np.array([[(i * 7919 + (s + salt) * 104729) % 40000 + 100 for i in range(prompt_tokens)]],
                                   dtype=np.int64)) for s in range(count)]

    pipe.generate(prompts(1, 10_000), [config])  # warm-up
    start = time.perf_counter()
    results = pipe.generate(prompts(streams, 0), [config] * streams)
    duration = time.perf_counter() - start
    produced = [len(r.m_generation_ids[0]) for r in results]
    if any(n != decode_tokens for n in produced):
        raise RuntimeError(f"OpenVINO produced {produced} tokens, not {decode_tokens} each")
    return {"streams": streams, "output_tokens_per_s": streams * decode_tokens / duration,
            "weight_bytes": weight_bytes(model),
            "precision": precision or "default", "openvino_genai": genai.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export")
    ex.add_argument("--gguf", type=Path, required=True)
    ex.add_argument("--out", type=Path, required=True)
    ex.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    tm = sub.add_parser("time")
    tm.add_argument("--model", type=Path, required=True)
    tm.add_argument("--threads", type=int, required=True)
    tm.add_argument("--prompt-tokens", type=int, default=128)
    tm.add_argument("--decode-tokens", type=int, default=64)
    tm.add_argument("--repeats", type=int, default=3)
    tm.add_argument("--precision", default=None, help="INFERENCE_PRECISION_HINT (default: OpenVINO's: bf16 where the CPU has it)")
    par = sub.add_parser("parallel")
    par.add_argument("--model", type=Path, required=True)
    par.add_argument("--threads", type=int, required=True)
    par.add_argument("--streams", type=int, required=True)
    par.add_argument("--prompt-tokens", type=int, default=128)
    par.add_argument("--decode-tokens", type=int, default=64)
    par.add_argument("--batched-tokens", type=int, default=512, help="SchedulerConfig.max_num_batched_tokens")
    par.add_argument("--precision", default=None)
    args = parser.parse_args()
    if args.command == "export":
        export(args.gguf, args.out, args.formats)
    elif args.command == "parallel":
        print(json.dumps(time_parallel(args.model, args.threads, args.streams, args.prompt_tokens, args.decode_tokens,
                                       args.batched_tokens, args.precision)))
    else:
        print(json.dumps(time_decode(args.model, args.threads, args.prompt_tokens, args.decode_tokens, args.repeats,
                                     args.precision)))


if __name__ == "__main__":
    main()
