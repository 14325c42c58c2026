"""Record an engine's logits, or compare them with a recording: does a change to kiln's kernels
or runtime leave an engine's numbers exactly as they were?

    python benchmarks/engine_logits.py ENGINE_DIR --save before.safetensors
    python benchmarks/engine_logits.py ENGINE_DIR --compare before.safetensors

For every instruction set this CPU runs (scalar, avx2, avx2vnni, avx512, avx512bf16, avx512amx) the
engine is loaded afresh (weights are laid out for the ISA at load) and run on fixed token ids: a 40-token
prefill in chunks (16, 24), then 6 single-token decode steps (the fused decode_layers path), then
one decode step of 3 sequences together. Each ISA's float32 logits are stored under its name.
--compare prints the largest difference per ISA and exits 1 unless all are 0 (bit for bit)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.plugins import ops
from kiln.runtime.engine import Engine, read_engine_json
from kiln.runtime.model import KVPool, StepContext

ISAS = ("scalar", "avx2", "avx2vnni", "avx512", "avx512bf16", "avx512amx")
SEED = 1234


def token_ids(vocab: int, count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count,), generator=g).tolist()


def run(engine: Engine) -> torch.Tensor:
    """Logits of the fixed schedule above, rows stacked in order."""
    spec, block_size = engine.spec, engine.limits.kv_block_size
    pool = KVPool(spec, 64, block_size, engine.model.kv_dtype)
    rows = []
    # sequence 0: a prefill in two chunks, then single-token decode steps
    ids = token_ids(spec.vocab_size, 46, SEED)
    table0 = [5, 3, 9, 1, 7, 11, 13, 15]
    start = 0
    for count in (16, 24, 1, 1, 1, 1, 1, 1):
        ctx = StepContext.single(start, count, table0, all_logits=True)
        rows.append(engine.model.forward(torch.tensor(ids[start:start + count]), ctx, pool))
        start += count
    # sequences 1 and 2: 8-token prefills, then one decode step of all three sequences together
    tables = [table0, [20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 34, 35, 36, 37]]
    others = [token_ids(spec.vocab_size, 9, SEED + s) for s in (1, 2)]
    for s, seq in enumerate(others, start=1):
        ctx = StepContext.single(0, 8, tables[s], all_logits=True)
        rows.append(engine.model.forward(torch.tensor(seq[:8]), ctx, pool))
    tokens = torch.tensor([ids[start - 1], others[0][8], others[1][8]])
    ctx = StepContext(positions=torch.tensor([start - 1, 8, 8]),
                      query_start=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                      context_lens=torch.tensor([start - 1, 8, 8], dtype=torch.int32),
                      block_tables=torch.tensor(tables, dtype=torch.int32), logits_rows=torch.arange(3))
    # the first sequence's last token again, at the same position: the pool slot is rewritten
    rows.append(engine.model.forward(tokens, ctx, pool))
    return torch.cat(rows)


def record(engine_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    ops.load_library(Path(engine_dir) / read_engine_json(Path(engine_dir))["plugins"]["file"])
    start = ops.active_isa()
    for isa in ISAS:
        try:
            ops.select_isa(isa)
        except RuntimeError:
            continue
        out[isa] = run(Engine(engine_dir)).contiguous()
        print(f"{isa}: {tuple(out[isa].shape)} logits", file=sys.stderr)
    ops.select_isa(start)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", help="write the logits to this .safetensors file")
    what.add_argument("--compare", help="compare with logits saved by --save")
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    got = record(args.engine)
    if args.save:
        save_file(got, args.save)
        return 0
    want = load_file(args.compare)
    same = True
    for isa in sorted(set(got) | set(want)):
        if isa not in got or isa not in want:
            print(f"{isa}: only in {'the recording' if isa in want else 'this run'}")
            same = False
            continue
        diff = (got[isa] - want[isa]).abs().max().item() if got[isa].shape == want[isa].shape else float("inf")
        print(f"{isa}: max |difference| {diff:.3g}{'  (bit for bit)' if torch.equal(got[isa], want[isa]) else ''}")
        same &= torch.equal(got[isa], want[isa])
    print(f"{args.engine}: {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
