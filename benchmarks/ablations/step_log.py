"""A step log (`runtime.step_log`: a JSON line a step, fields kiln.constants.STEP_LOG_FIELDS)
summarized: per executor run in it (a run's steps count from 1 again, so the in-process run and
then the server's of one `benchmarks/serving.py --runtime 'step_log="..."'` are two), the decode-
only steps of many sequences, the steps that decode beside a prompt's chunk, and the gaps from
one step's end to the next's, as medians and p99s; and the steps' total time against the run's.

    PYTHONPATH=. python benchmarks/ablations/step_log.py docs/img/steps-int8-sq-inprocess-then-grpc.jsonl
"""
import argparse
import json
from pathlib import Path

from kiln.bench import percentile


def runs_of(path: Path) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for line in path.read_text().splitlines():
        step = json.loads(line)
        if step["step"] == 1 or not runs:
            runs.append([])
        runs[-1].append(step)
    return runs


def summary(run: list[dict], min_decoding: int, min_mixed: int) -> dict:
    decode = [s["ms"] for s in run if s["tokens"] == s["decode_tokens"] and s["sequences"] >= min_decoding]
    mixed = [s["ms"] for s in run if s["tokens"] > s["decode_tokens"] >= min_mixed]
    # a step's line is written as it ends: the next one began `ms` before its own end
    gaps = [(b["time"] - a["time"]) * 1000 - b["ms"] for a, b in zip(run, run[1:])]
    return {"steps": len(run),
            "decode_only": {"n": len(decode), "p50_ms": percentile(decode, 50), "p99_ms": percentile(decode, 99)},
            "mixed": {"n": len(mixed), "p50_ms": percentile(mixed, 50), "p99_ms": percentile(mixed, 99)},
            "gap": {"p50_ms": percentile(gaps, 50), "p99_ms": percentile(gaps, 99)},
            "steps_s": sum(s["ms"] for s in run) / 1000, "span_s": run[-1]["time"] - run[0]["time"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("--min-decoding", type=int, default=12, help="decode-only steps of at least this many rows")
    parser.add_argument("--min-mixed", type=int, default=8, help="mixed steps decoding at least this many rows")
    args = parser.parse_args()
    for index, run in enumerate(runs_of(args.log), 1):
        s = summary(run, args.min_decoding, args.min_mixed)
        d, m, g = s["decode_only"], s["mixed"], s["gap"]
        print(f"run {index}: {s['steps']} steps; decode only ({args.min_decoding}+ rows) {d['n']}: "
              f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f} ms; beside a prompt's chunk ({args.min_mixed}+ decoding) "
              f"{m['n']}: {m['p50_ms']:.1f} / {m['p99_ms']:.1f} ms; gap {g['p50_ms']:.2f} / {g['p99_ms']:.2f} ms; "
              f"steps {s['steps_s']:.2f} s of {s['span_s']:.2f} s")


if __name__ == "__main__":
    main()
