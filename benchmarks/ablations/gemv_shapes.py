"""One-thread GEMV speed per weight shape: int4 (kiln::linear_w4 and linear_w4_tiled, group 64), W4A8
(linear_w4a8 and linear_w4a8_tiled), int8 (kiln::linear_w8 and linear_w8_tiled) and bf16 (kiln::linear) on one bf16
input row, weights repeated call after
call (so small matrices are cache-resident), median of 5. docs/benchmarks.md quotes it.

    PYTHONPATH=. python benchmarks/ablations/gemv_shapes.py [N K ...]   (default: SmolLM2's and 7B shapes)"""
import statistics
import sys
import time

import torch

from kiln.plugins import ops
from kiln.plugins.build import build_plugins

ops.load_library(build_plugins())
torch.set_num_threads(1)
args = [int(a) for a in sys.argv[1:]]
shapes = list(zip(args[::2], args[1::2])) or [(960, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 2048),
                                             (4096, 4096), (8192, 8192)]
for n, k in shapes:
    w4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s4 = torch.rand(n, -(-k // 64)) + 0.5
    w8, s8 = torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n)
    wb = torch.randn(n, k).bfloat16()
    x = torch.randn(1, k).bfloat16()
    reps = max(20, int(2e8 // (n * k)))
    cells = []
    t4, ts4 = ops.pack_int4_tiled(w4, s4, 64)
    t8 = ops.pack_int8_tiled(w8)
    for name, f, nbytes in [("int4", lambda: ops.linear_w4(x, w4, s4, 64), n * k // 2),
                            ("int4 tiled", lambda: ops.linear_w4_tiled(x, t4, ts4, 64), n * k // 2),
                            ("w4a8", lambda: ops.linear_w4a8(x, w4, s4, 64), n * k // 2),
                            ("w4a8 tiled", lambda: ops.linear_w4a8_tiled(x, t4, ts4, 64), n * k // 2),
                            ("int8", lambda: ops.linear_w8(x, w8, s8), n * k),
                            ("int8 tiled", lambda: ops.linear_w8_tiled(x, t8, s8), n * k),
                            ("bf16", lambda: ops.linear(x, wb), n * k * 2)]:
        for _ in range(3):
            f()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                f()
            times.append((time.perf_counter() - start) / reps)
        m = statistics.median(times)
        cells.append(f"{name} {m * 1e6:8.1f} us {nbytes / m / 1e9:5.1f} GB/s")
    print(f"{n:6d} x {k:5d}  " + "  ".join(cells), flush=True)
