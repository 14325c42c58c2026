"""Gemma 3's KV cache: a block table per group of layers (the runtime's layout) against one table
for every layer (what kiln did before: nothing released, as the global layers need every
position). A random Gemma 3 with the 1B model's attention (26 layers, every 6th global, a window of
512, one KV head of 256) and a small MLP and vocabulary: the cache does not depend on them, so a
decode step here is mostly attention and the runtime's own work, the worst case for the cost of
more tables. Sequences of a 64-token prompt generate `--tokens` tokens, one alone and four at
once; for each layout: the KV bytes held at the peak (blocks in use x bytes a block, counted by
the block pool) and decode tokens/s. The one-table layout is the same runtime with
KVPool.layout_for forced to grouped=False.

    cd benchmarks && PYTHONPATH=.. python kv_groups.py --threads 1 --json ../docs/img/kv-groups-1t.json
    cd benchmarks && PYTHONPATH=.. python kv_groups.py --layouts 32768   # the arithmetic for Gemma 3's sizes

Each run also splits its time between the model step (LlamaModel.forward) and the rest (the
scheduler, block accounting, sampling).

Prints a table of medians and writes JSON. No timing is asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from host import host_info
from moe import write_tokenizer
from rich.console import Console
from rich.table import Table

VOCAB, LAYERS, WINDOW, PATTERN = 16384, 26, 512, 6
PROMPT = 64


def write_model(folder: Path, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    types = ["full_attention" if i % PATTERN == PATTERN - 1 else "sliding_attention" for i in range(LAYERS)]
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW, layer_types=types,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def build(folder: Path, out: Path, max_seq_len: int) -> Path:
    from kiln.builder.cli import build as run_build

    config = {"model": {"checkpoint": str(folder), "dtype": "bfloat16"},
              "build": {"max_batch_size": 4, "max_input_len": PROMPT, "max_seq_len": max_seq_len,
                        "max_num_tokens": 256}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.yaml").write_text(yaml.safe_dump(config))
    engine_dir, _ = run_build(out / "build.yaml", out)
    return engine_dir


def run(engine_dir: Path, grouped: bool, sequences: int, tokens: int) -> dict:
    """One generation of `sequences` sequences at once under one layout: peak KV bytes, tok/s."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.model import KVPool, LlamaModel

    layout_for = KVPool.__dict__["layout_for"]
    if not grouped:
        KVPool.layout_for = staticmethod(lambda spec, grouped: layout_for.__func__(spec, False))
    forward, in_model = LlamaModel.forward, [0.0]

    def timed_forward(self, *args, **kwargs):  # the model step's share of the time
        begin = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            in_model[0] += time.perf_counter() - begin

    LlamaModel.forward = timed_forward
    try:
        llm = LLM(engine_dir, kv_cache_memory="1GiB", enable_prefix_reuse=False)
        try:
            executor = llm.executor
            g = torch.Generator().manual_seed(sequences)
            prompts = [torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist() for _ in range(sequences)]
            executor.kv.reset_peak()
            start = time.perf_counter()
            outs = llm.generate(prompts, max_tokens=tokens, ignore_eos=True)
            seconds = time.perf_counter() - start
            assert all(len(o.token_ids) == tokens for o in outs)
            per_block = executor.pool.storage[:, :, 0].nbytes
            return {"layout": executor.pool.layout.describe(), "tables": len(executor.pool.layout.groups),
                    "tok_s": sequences * tokens / seconds, "model_s": in_model[0], "rest_s": seconds - in_model[0],
                    "peak_kv_bytes": executor.kv.stats()["blocks_used_peak"] * per_block,
                    "tokens": [o.token_ids for o in outs]}
        finally:
            llm.close()
    finally:
        KVPool.layout_for = layout_for
        LlamaModel.forward = forward


# Gemma 3's released sizes: layers and window (every sixth layer global, one KV head of 256 ... each)
GEMMA3_SIZES = {"1B": (26, 512), "4B": (34, 1024), "12B": (48, 1024), "27B": (62, 1024)}


def layout_savings(tokens: int, step_tokens: int, block_size: int = 32) -> list[dict]:
    """By the layout's arithmetic: the KV a sequence of `tokens` holds at most with a table per
    layer group, against one table for every layer (slot-blocks; each slot one layer's block)."""
    from kiln.runtime.kv_cache import KVCacheManager
    from kiln.runtime.kv_layout import KVLayout

    rows = []
    for size, (layers, window) in GEMMA3_SIZES.items():
        layout = KVLayout.of([0 if i % PATTERN == PATTERN - 1 else window for i in range(layers)])
        kv = KVCacheManager(1, block_size, windows=layout.windows)
        grouped, one_table = kv.peak_blocks(tokens, step_tokens) * layout.slots, kv.blocks_for(tokens) * layers
        rows.append({"model": f"Gemma 3 {size}", "layout": layout.describe(), "ratio": one_table / grouped})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens each sequence generates")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout, alternating")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--layouts", type=int, metavar="TOKENS",
                        help="only print the layout's arithmetic for Gemma 3's sizes at this many tokens")
    args = parser.parse_args()
    if args.layouts:
        for row in layout_savings(args.layouts, step_tokens=1):
            print(f"{row['model']}: {row['layout']}; {row['ratio']:.2f}x less KV than one table")
        return
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(write_model(Path(tmp) / "hf"), Path(tmp) / "engine", PROMPT + args.tokens)
        for sequences in (1, 4):
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for _ in range(args.rounds):
                for grouped in (False, True):
                    runs[grouped].append(run(engine, grouped, sequences, args.tokens))
            same = runs[True][0]["tokens"] == runs[False][0]["tokens"]
            for grouped in (False, True):
                rows.append({"sequences": sequences, "grouped": grouped, "layout": runs[grouped][0]["layout"],
                             "tables": runs[grouped][0]["tables"],
                             "peak_kv_mib": runs[grouped][0]["peak_kv_bytes"] / 2**20,
                             "tok_s_median": statistics.median(r["tok_s"] for r in runs[grouped]),
                             "tok_s": [r["tok_s"] for r in runs[grouped]], "same_tokens": same,
                             "model_s": [r["model_s"] for r in runs[grouped]],
                             "rest_s": [r["rest_s"] for r in runs[grouped]]})
    table = Table(title=f"Gemma 3 (1B attention, window {WINDOW}): {args.tokens} tokens a sequence, "
                        f"{args.threads} thread(s), median of {args.rounds}")
    for column in ("sequences", "layout", "peak KV (MiB)", "decode tok/s", "vs one table", "model step s (rest s)",
                   "same tokens"):
        table.add_column(column)
    for row in rows:
        base = next(r for r in rows if r["sequences"] == row["sequences"] and not r["grouped"])
        table.add_row(str(row["sequences"]), f"{row['tables']} block table(s)", f"{row['peak_kv_mib']:.1f}", f"{row['tok_s_median']:.1f}",
                      f"{row['tok_s_median'] / base['tok_s_median']:.2f}x, KV {base['peak_kv_mib'] / row['peak_kv_mib']:.2f}x less",
                      f"{statistics.median(row['model_s']):.2f} ({statistics.median(row['rest_s']):.2f})",
                      str(row["same_tokens"]))
    Console().print(table)
    print("layouts:", *sorted({row["layout"] for row in rows}), sep="\n  ")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"host": host_info(), "threads": args.threads, "tokens": args.tokens,
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
