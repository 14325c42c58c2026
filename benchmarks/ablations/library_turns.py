"""The side-by-side runs of the ablations that time ops on several builds of the plugin library
(one library a process): each round runs the calling script once per library, each in a process
of its own, in turn, so a noisy neighbour slows them alike."""
from __future__ import annotations

import json
import subprocess
import sys


def in_turns(script: str, libraries: list[str], rounds: int, args: list[str]) -> dict[str, list]:
    """library -> one result per round: the JSON the last line of `script --libraries ... --measure
    LIBRARY *args` prints."""
    runs: dict[str, list] = {lib: [] for lib in libraries}
    for _ in range(rounds):
        for lib in libraries:
            done = subprocess.run([sys.executable, script, "--libraries", *libraries, "--measure", lib, *args],
                                  check=True, capture_output=True, text=True)
            runs[lib].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs
