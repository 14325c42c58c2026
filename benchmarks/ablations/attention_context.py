"""kiln::paged_attention for one decode token (SmolLM2's 9 heads / 3 KV heads / 64, bf16 pool) at
several cached lengths, for 128-token prefill chunks (one alone, four together, one after 384 cached
tokens), and for 16 and 64 sequences decoding
together at 136 cached tokens each (their blocks scattered over a pool, as a serving pool's are),
on 1 and 2 threads: warm (called again and again) and cold (64 MB read between calls, as the
weights a decode step streams evict the KV cache). Median of the calls. With --kv-cache int8 or fp8
the pools hold that type, with per-channel scales, as an engine built with `kv_cache: int8 / fp8`.

    PYTHONPATH=. python benchmarks/ablations/attention_context.py --threads 1 2 --isa avx2

With --library NAME=PATH (twice or more) it compares plugin libraries (e.g. the one inside an
engine built by another version of kiln against this tree's): one process per library and
thread count, the libraries taking turns for --rounds rounds, medians over the rounds, each
against the first. A library older than engine format 10 reads token-major blocks: name it with
--token-major NAME and its pools are made [blocks, block_size, kv_heads, head_dim]. No timing is
asserted anywhere."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (label, sequences, cached tokens, new tokens each): one decode token at several cached lengths,
# a 128-token prefill chunk (its RoPE, KV write and causal attention), and many sequences' decode
# tokens together
CASES = (("1", 1, 1, 1), ("190", 1, 190, 1), ("1000", 1, 1000, 1), ("4000", 1, 4000, 1), ("prefill128", 1, 0, 128),
         ("4xprefill128", 4, 0, 128), ("prefill128+384", 1, 384, 128), ("16x136", 16, 136, 1), ("64x136", 64, 136, 1))
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32


def measure(library: str | None, threads: int, isa: str | None, calls: int, token_major: bool,
            kv_cache: str) -> dict[str, float]:
    """{"<case> warm|cold": median µs} in this process."""
    import torch

    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins
    from kiln.plugins.reference import store_kv

    quantized_pools = {"int8": (torch.int8, 1 / 40), "fp8": (torch.float8_e4m3fn, 1 / 100)}  # scales for randn's range

    ops.load_library(library or build_plugins())
    if isa:
        ops.select_isa(isa)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    junk = torch.randn(16 << 20)
    cos, sin = torch.randn(8192, HEAD_DIM).bfloat16(), torch.randn(8192, HEAD_DIM).bfloat16()
    out = {}
    for label, seqs, cached, new in CASES:
        per_seq = (cached + new) // BLOCK + 2
        scattered = seqs > 1  # many sequences: theirs in random order among 8x as many blocks
        blocks = seqs * per_seq * (8 if scattered else 1)
        block_shape = (BLOCK, KV_HEADS) if token_major else (KV_HEADS, BLOCK)
        k_pool = torch.randn(blocks, *block_shape, HEAD_DIM).bfloat16()
        v_pool = torch.randn(blocks, *block_shape, HEAD_DIM).bfloat16()
        scales = None
        if kv_cache != "none":  # quantized as the engine stores keys and values, one scale for all
            pool_dtype, scale = quantized_pools[kv_cache]
            k_pool, v_pool = (store_kv(p.reshape(-1, 1, HEAD_DIM), pool_dtype, torch.full((HEAD_DIM,), scale))
                              .reshape(p.shape) for p in (k_pool, v_pool))
            scales = torch.full((2, KV_HEADS * HEAD_DIM), scale)
        qkv = torch.randn(seqs * new, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)) if scattered else torch.arange(blocks)
        tables = order[: seqs * per_seq].to(torch.int32).reshape(seqs, per_seq).contiguous()
        starts = torch.arange(0, seqs * new + 1, new, dtype=torch.int32)
        lens = torch.full((seqs,), cached, dtype=torch.int32)
        for cold in (False, True):
            times = []
            for _ in range(calls if not cold else max(calls // 10, 20)):
                if cold:
                    junk.sum()
                start = time.perf_counter()
                ops.paged_attention(qkv, k_pool, v_pool, tables, starts, lens, cos, sin, HEADS, HEAD_DIM**-0.5, scales)
                times.append(time.perf_counter() - start)
            out[f"{label} {'cold' if cold else 'warm'}"] = statistics.median(times[len(times) // 10:]) * 1e6
    return out


def child(library: str, threads: int, isa: str | None, calls: int, token_major: bool,
          kv_cache: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", library, "--threads", str(threads), "--calls", str(calls),
               "--kv-cache", kv_cache]
    if token_major:
        command.append("--child-token-major")
    if isa:
        command += ["--isa", isa]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{library}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--isa", default=None, help="kernel level (default: the best this CPU runs)")
    parser.add_argument("--library", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--kv-cache", choices=("none", "int8", "fp8"), default="none",
                        help="the pools' type (none: bf16, the model's)")
    parser.add_argument("--token-major", action="append", default=[], metavar="NAME",
                        help="a --library before engine format 10: its pools are token-major")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-token-major", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child or None, args.threads[0], args.isa, args.calls, args.child_token_major,
                                   args.kv_cache)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from host import host_info

    libraries = dict(spec.split("=", 1) for spec in args.library) or {"this tree": ""}
    rounds = args.rounds if args.library else 1
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(rounds):
        for threads in args.threads:
            for name, path in libraries.items():
                runs.setdefault((name, threads), []).append(
                    child(path, threads, args.isa, args.calls, name in args.token_major, args.kv_cache))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    rows = []
    for (name, threads), results in runs.items():
        medians = {key: statistics.median(run[key] for run in results) for key in results[0]}
        rows.append({"library": name, "threads": threads, "us": medians})
    first = {row["threads"]: row["us"] for row in rows if row["library"] == next(iter(libraries))}
    keys = list(rows[0]["us"])
    print(f"paged_attention, µs (median of {rounds} rounds; isa {args.isa or 'best'}; pools {args.kv_cache})")
    widths = [max(len(key), 13 if len(libraries) > 1 else 7) for key in keys]
    print("library        threads  " + "  ".join(f"{key:>{w}s}" for key, w in zip(keys, widths)))
    for row in rows:
        cells = [f"{row['us'][key]:7.1f}" + (f" {first[row['threads']][key] / row['us'][key]:.2f}x"
                                            if len(libraries) > 1 else "") for key in keys]
        print(f"{row['library']:14s} {row['threads']:7d}  "
              + "  ".join(f"{cell:>{w}s}" for cell, w in zip(cells, widths)))
    if args.json:
        args.json.write_text(json.dumps({"host": host_info(), "isa": args.isa, "kv_cache": args.kv_cache,
                                         "cases": [list(case) for case in CASES],
                                         "rounds": rounds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
