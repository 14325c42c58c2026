"""The plugin library compiles into an empty cache and loads in a fresh process (the path a
new machine takes), and a second build reuses the cache."""
import os
import subprocess
import sys

SCRIPT = """
import torch
from kiln.plugins.build import build_plugins
from kiln.plugins import ops, reference
path = build_plugins()
built_at = path.stat().st_mtime_ns
ops.load_library(path)
x, w = torch.randn(3, 50), torch.randn(50)
torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
assert build_plugins() == path and path.stat().st_mtime_ns == built_at, "cache not reused"
print(path)
"""


def test_compiles_into_an_empty_cache_and_loads(tmp_path):
    env = dict(os.environ, KILN_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith(str(tmp_path))
    assert [p.name for p in (tmp_path / "plugins").iterdir()] == [result.stdout.strip().split("/")[-2]]


# Kernels whose bodies are plain loops on every instruction set are named *_ref. The AVX2 table
# may hold only these, each kept off the hot paths for the reason given.
AVX2_REFERENCE_KERNELS = {
    "linear_w8_tiled_ref": "int8 weights are laid out tiled only on AVX-512 (select.h: kTiledInt8)",
    "dequantize_int8_tiled_ref": "int8 weights are laid out tiled only on AVX-512 (select.h: kTiledInt8)",
    "linear_w4a8_ref": "only W4A8 weights whose shape the tiled layout cannot hold (out_features % 16)",
    "linear_w8a8_tiled_ref": "W8A8 weights are laid out tiled only where AVX-512 VNNI multiplies them (select.h: "
                             "kTiledW8A8)",
}


def test_avx2_hot_paths_run_no_reference_kernel(plugin_isas):
    """No x86-64-v3 CPU runs a plain-loop kernel on a hot path: the reference kernels compiled
    into the AVX2 tables, with and without AVX-VNNI (symbols kiln::avx2::*_ref,
    kiln::avx2vnni::*_ref), are exactly the ones listed, and the runtime on AVX2 tiles int4
    weights (vectorized) but not int8 (whose tiled kernel is a reference there)."""
    import re

    from kiln.plugins import ops
    from kiln.plugins.build import build_plugins

    symbols = subprocess.run(["nm", "-C", "--defined-only", str(build_plugins())], capture_output=True, text=True,
                             check=True, timeout=120).stdout
    for table in ("avx2", "avx2vnni"):
        found = set(re.findall(rf"kiln::{table}::(\w+_ref)<", symbols))
        assert found == set(AVX2_REFERENCE_KERNELS), (
            f"reference kernels in the {table} table: {sorted(found)}; listed: {sorted(AVX2_REFERENCE_KERNELS)}")
        assert f"kiln::{table}::linear_w4_tiled_dp<" in symbols and f"kiln::{table}::linear_w8_i16<" in symbols
        if table in plugin_isas:
            try:
                ops.select_isa(table)
                assert ops.tiled("int4") and not ops.tiled("int8")
            finally:
                ops.select_isa(os.environ.get("KILN_ISA", "auto"))
