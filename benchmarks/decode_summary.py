"""Several runs of decode_latency.py -> one table of medians (and the range of the ratio to the
first engine), a JSON with every run, and a bar chart.

    python benchmarks/decode_summary.py run1.json run2.json run3.json \
        --json docs/img/decode-current.json --plot docs/img/decode-current.png

Runs on a busy 2-core machine move by 10-20%, so the ratio to the first engine (measured side by
side within each run) is the figure to compare; the table gives its median and range."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def label(name: str) -> str:
    """'kiln bfloat16 int4_awq [avx2]' -> 'int4_awq [avx2]'; 'kiln bfloat16' -> 'bf16'."""
    words = name.removeprefix("kiln ").split()
    if len(words) > 1 and words[0] in ("bfloat16", "float32") and not words[1].startswith("["):
        words = words[1:]  # a quantized engine: its algorithm names it
    return " ".join(words).replace("bfloat16", "bf16")


def summarize(runs: list[dict]) -> list[dict]:
    rows = {}
    for run in runs:
        for row in run["rows"]:
            entry = rows.setdefault((row["threads"], row["name"]), {"threads": row["threads"], "name": row["name"],
                                                                     "prefill_ms": [], "decode_tok_s": [],
                                                                     "decode_vs_first": []})
            for key in ("prefill_ms", "decode_tok_s", "decode_vs_first"):
                entry[key].append(row[key])
    return [{**entry, **{f"{key}_median": statistics.median(entry[key])
                         for key in ("prefill_ms", "decode_tok_s", "decode_vs_first")}} for entry in rows.values()]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(names)), 4))
    width = 0.8 / len(threads)
    for i, t in enumerate(threads):
        values = [next(r["decode_tok_s_median"] for r in rows if r["threads"] == t and r["name"] == n) for n in names]
        bars = ax.bar([x + i * width for x in range(len(names))], values, width, label=f"{t} thread{'s' * (t > 1)}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([x + width * (len(threads) - 1) / 2 for x in range(len(names))], [label(n) for n in names],
                  rotation=30 if len(names) > 8 else 0, ha="right" if len(names) > 8 else "center", fontsize=8)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files written by decode_latency.py --json")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    runs = [json.loads(p.read_text()) for p in args.runs]
    rows = summarize(runs)
    meta = runs[0]["meta"]
    title = (f"batch-1 decode, medians of {len(runs)} runs ({meta.get('cpu', '?')}, {meta.get('kiln_isa', '?')} "
             f"kernels, {meta.get('date', '?')}, kiln {meta.get('kiln_commit', '?')})")
    table = Table(title=title)
    for column in ("threads", "engine", "prefill ms", "decode tok/s", "× first engine (range)"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["threads"]), escape(label(r["name"])), f"{r['prefill_ms_median']:.1f}",
                      f"{r['decode_tok_s_median']:.1f}",
                      f"{r['decode_vs_first_median']:.2f}x ({min(r['decode_vs_first']):.2f}-"
                      f"{max(r['decode_vs_first']):.2f})")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": [run["meta"] for run in runs], "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot, title)


if __name__ == "__main__":
    main()
