"""The host CPU's name, as /proc/cpuinfo gives it: what engine.json's tactics and the tactics
cache are keyed by, and what benchmarks quote."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
