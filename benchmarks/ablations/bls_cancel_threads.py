"""The BLS model's process while its clients cancel or drop streams: rounds of 8 concurrent BLS
streams, each cancelled or dropped after a few responses (or, with `complete`, left to finish),
and after each round the BLS stub's resident memory, threads and open files. A cancelled stream
that leaves something behind shows as a count that grows round after round.

    python benchmarks/ablations/bls_cancel_threads.py out/smollm2-bf16/triton_repo cancel 15

Prints one line per round; asserts nothing."""
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving_faults import one_request  # noqa: E402

from kiln.triton_repo.serve import TritonServer, group_members  # noqa: E402


def bls_pid(server: TritonServer) -> int:
    for pid in group_members(server.process.pid):
        try:
            if b"_bls" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise RuntimeError("no BLS process in the server")


def stats(pid: int) -> str:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss_mb = int(status["VmRSS"].split()[0]) / 1024
    return f"rss {rss_mb:.1f} MB, threads {status['Threads'].strip()}, fds {len(list(Path(f'/proc/{pid}/fd').iterdir()))}"


def main() -> None:
    repo, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert mode in ("cancel", "complete"), "mode: cancel (cancel or drop each stream) or complete"
    rng = random.Random(20261201)
    with TritonServer(repo) as server:
        bls = next(p.name for p in server.repo.iterdir() if p.name.endswith("_bls"))
        pid = bls_pid(server)
        print(f"BLS process {pid}: {stats(pid)}", flush=True)
        for r in range(rounds):
            outcomes: list[str] = []

            def client(seed: float) -> None:
                outcomes.append(one_request(server, bls, random.Random(seed), 1.0 if mode == "cancel" else 0.0, 60,
                                            max_tokens=48))

            threads = [threading.Thread(target=client, args=(rng.random(),)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(1)
            print(f"round {r}: {sorted(set(outcomes))} -> {stats(pid)}", flush=True)


if __name__ == "__main__":
    main()
