"""`kiln eval --engine DIR --text FILE [--reference CHECKPOINT] [--stride N] [--json]`:
perplexity of an engine on any text file, and of the unquantized checkpoint beside it."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln eval", description=__doc__)
    parser.add_argument("--engine", required=True, type=Path)
    parser.add_argument("--text", required=True, type=Path, help="a UTF-8 text file")
    parser.add_argument("--reference", type=Path, default=None,
                        help="the unquantized checkpoint (HF folder, .gguf, package:PKG/FILE) to compare with")
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default: max_input_len)")
    parser.add_argument("--stride", type=int, default=None, help="window step (default: window / 2)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import Progress

    from kiln.builder.compile import float32_model
    from kiln.builder.config import resolve_checkpoint
    from kiln.quantize.evaluate import perplexity
    from kiln.runtime.engine import Engine

    engine = Engine(args.engine)
    ids = engine.tokenizer.encode(args.text.read_text(encoding="utf-8")).ids
    window = args.window or engine.limits.max_input_len
    stride = args.stride or max(window // 2, 1)
    block = engine.limits.kv_block_size
    models = {"engine": engine.model}
    if args.reference:
        models["reference"] = float32_model(resolve_checkpoint(str(args.reference), Path.cwd()),
                                            engine.limits.max_seq_len)
    results = {}
    with Progress(console=Console(stderr=True), transient=True) as bar:
        for name, model in models.items():
            task = bar.add_task(f"{name} perplexity", total=None)
            results[name] = asdict(perplexity(model, ids, window, stride, block,
                                              lambda done, total: bar.update(task, completed=done, total=total)))
    report = {"text": str(args.text), "text_tokens": len(ids), "window": window, "stride": stride,
              "engine": str(args.engine), **results}
    if args.reference:
        report["relative_increase"] = results["engine"]["perplexity"] / results["reference"]["perplexity"] - 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(ids)} tokens, windows of {window}, stride {stride}")
        for name in models:
            print(f"{name:>9}: perplexity {results[name]['perplexity']:.4f} "
                  f"({results[name]['tokens']} tokens scored)")
        if args.reference:
            print(f"relative increase: {100 * report['relative_increase']:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
