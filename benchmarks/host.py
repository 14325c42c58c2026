"""What a benchmark ran on, for its JSON: the CPU and its vector extensions, the kernels kiln
runs there, the kiln commit, the date, the machine's load."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

from kiln.builder.tactics import median_us
from kiln.plugins.host import cpu_model


def cpu_flags() -> list[str]:
    """The AVX family flags /proc/cpuinfo lists (as `grep -o 'avx[^ ]*' /proc/cpuinfo`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted({f for f in line.split(":", 1)[1].split() if f.startswith("avx")})
    except OSError:
        pass
    return []


def kiln_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host_info() -> dict:
    info = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "kiln_commit": kiln_commit(), "date": datetime.date.today().isoformat()}
    try:
        from kiln.plugins import ops

        info["kiln_isa"] = ops.active_isa()
    except Exception:  # the plugin library is not loaded (no kiln engine in this run)
        pass
    return info


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s that a sum over a large float32 tensor reads on `threads` threads (median): the
    read-bandwidth ceiling the decode benchmarks quote. Leaves torch on that many threads."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30 / 4))
    return x.nbytes / (median_us(x.sum, repeats) / 1e6)


def gemm_macs(threads: int, size: int = 1024, repeats: int = 5) -> dict:
    """Multiply-accumulates/s of PyTorch's (oneDNN's) square GEMMs on `threads` threads (median):
    float32, bfloat16 and int8 (torch._int_mm) where this build runs them. The largest is the
    compute ceiling the concurrency benchmarks quote. Leaves torch on that many threads."""
    import torch

    torch.set_num_threads(threads)
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        if dtype is torch.int8:
            a = torch.randint(-64, 64, (size, size), dtype=dtype)
            b = torch.randint(-64, 64, (size, size), dtype=dtype)
            mm = torch._int_mm
        else:
            a, b, mm = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype), torch.mm
        try:
            rates[name] = size**3 / (median_us(lambda: mm(a, b), repeats) / 1e6)
        except RuntimeError:  # not on this build / CPU
            continue
    return rates
