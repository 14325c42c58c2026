"""benchmarks/serving.py's JSONs in one figure: output tokens/s, the inter-token p99 and the time
to first token's p99 against concurrency, a line per engine and path (gRPC solid, in process
dashed), and a table of the same figures printed.

    python benchmarks/serving_plot.py int4_awq=docs/img/serving-int4-awq.json \\
        w4a8_awq=docs/img/serving-w4a8-awq.json --out docs/img/serving-concurrency.png \\
        --title "SmolLM2-135M, 2 threads, AVX2"

Draws and prints; asserts nothing."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

PATH_STYLE = {"gRPC": "-", "in-process": "--"}
PANELS = (("tokens_per_s", "output tokens/s", "linear"), ("itl_p99_ms", "inter-token p99, ms", "log"),
          ("ttft_p99_ms", "time to first token p99, ms", "log"))


def load(specs: list[str]) -> dict[str, list[dict]]:
    """{engine label: its rows} from LABEL=FILE arguments"""
    runs = {}
    for spec in specs:
        label, sep, file = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: give LABEL=FILE")
        runs[label] = json.loads(Path(file).read_text())["rows"]
    return runs


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    levels = sorted({r["concurrency"] for rows in runs.values() for r in rows})
    for ax, (key, name, scale) in zip(axes, PANELS):
        for index, (label, rows) in enumerate(runs.items()):
            for path, style in PATH_STYLE.items():
                points = sorted((r["concurrency"], r[key]) for r in rows if r["path"] == path)
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=colors[index % len(colors)],
                            label=f"{label} ({path})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(level) for level in levels])
        ax.set_yscale(scale)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=FILE", help="serving.py --json outputs")
    parser.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    parser.add_argument("--title", default="serving: tokens/s and p99 latencies against concurrency")
    args = parser.parse_args()
    runs = load(args.runs)
    table = Table(title="latencies in ms")
    for column in ("engine", "path", "streams", "tok/s", "x 1 stream", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"):
        table.add_column(column, justify="right")
    for label, rows in runs.items():
        for r in rows:
            table.add_row(label, r["path"], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}",
                          f"{r.get('throughput_vs_c1', 0):.2f}", f"{r['ttft_p50_ms']:,.0f}", f"{r['ttft_p99_ms']:,.0f}",
                          f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}")
    Console(width=160).print(table)
    plot(runs, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
