"""Summarize NVIDIA AIPerf runs (one `--artifact-dir` per concurrency level) as one table, and
write the figures as JSON (and a plot with --plot).

    python benchmarks/aiperf_table.py /tmp/aiperf/c1 /tmp/aiperf/c4 ... --json out.json --plot out.png

Each folder holds AIPerf's profile_export_aiperf.json; the table gives the level's concurrency,
requests, output tokens/s, requests/s, and TTFT / inter-token / request latency at P50 and P99."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

COLUMNS = [  # (heading, AIPerf metric, statistic)
    ("tok/s", "output_token_throughput", "avg"),
    ("req/s", "request_throughput", "avg"),
    ("TTFT p50", "time_to_first_token", "p50"),
    ("TTFT p99", "time_to_first_token", "p99"),
    ("ITL p50", "inter_token_latency", "p50"),
    ("ITL p99", "inter_token_latency", "p99"),
    ("E2E p50", "request_latency", "p50"),
    ("E2E p99", "request_latency", "p99"),
]


def summarize(folder: Path) -> dict:
    path = folder / "profile_export_aiperf.json"
    data = json.loads(path.read_text())
    config = data["input_config"]
    profiling = [phase for phase in config.get("phases", []) if phase.get("kind") == "profiling"]
    concurrency = profiling[0].get("concurrency") if profiling else None
    row = {"folder": str(folder), "concurrency": concurrency,
           "requests": int(data["request_count"]["avg"]),
           "errors": data.get("error_summary") or [],
           "prompt_tokens": data.get("usage_prompt_tokens", {}).get("avg"),
           "output_tokens": data.get("usage_completion_tokens", {}).get("avg")}
    for heading, metric, statistic in COLUMNS:
        row[heading] = data[metric][statistic]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="throughput and latency against concurrency (PNG)")
    parser.add_argument("--title", default="AIPerf")
    args = parser.parse_args(argv)
    rows = sorted((summarize(folder) for folder in args.folders), key=lambda r: r["concurrency"] or 0)
    table = Table(title=f"{args.title} (latencies in ms)")
    for heading in ["concurrency", "requests", "errors", *[c[0] for c in COLUMNS]]:
        table.add_column(heading, justify="right")
    for row in rows:
        table.add_row(str(row["concurrency"]), str(row["requests"]), str(len(row["errors"])),
                      *[f"{row[c[0]]:.1f}" if row[c[0]] is not None else "-" for c in COLUMNS])
    Console(width=160).print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        levels = [row["concurrency"] for row in rows]
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(levels, [row["tok/s"] for row in rows], marker="o")
        left.set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log", title="throughput")
        for heading in ("TTFT p50", "ITL p50", "ITL p99"):
            right.plot(levels, [row[heading] for row in rows], marker="o", label=heading)
        right.set(xlabel="concurrent streams", ylabel="ms", xscale="log", yscale="log", title="latency")
        right.legend()
        for axis in (left, right):
            axis.set_xticks(levels, [str(level) for level in levels])
        figure.suptitle(args.title)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
