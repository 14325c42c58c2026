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
