"""Compile the plugin library with PyTorch's extension tooling, cached by content hash.

The library is one translation unit (csrc/library.cpp, which includes the kernel and op headers)
holding every kernel for every instruction set (scalar, AVX2, AVX-512) with the choice made once
when it loads, so the file copied into an engine runs on any x86-64 host. Compiling takes tens of seconds; the cache key covers the sources,
flags, compiler and torch version, so nothing is compiled twice."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIBRARY_NAME = "kiln_plugins"
LIBRARY_FILE = f"{LIBRARY_NAME}.so"
CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]  # no silent FMA: rounding as written
LDFLAGS = ["-fopenmp"]


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "plugins"


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"no C++ compiler found ({cxx!r}): install g++ to build engines") from exc


def source_hash() -> str:
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(path.relative_to(CSRC).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_compiler_version().encode())
    return digest.hexdigest()[:16]


def build_plugins(verbose: bool = False) -> Path:
    """Return the path of the compiled library, compiling it only when the cache lacks it.

    The compiler runs in a child process: PyTorch's tooling loads what it builds, and the
    `kiln` op namespace can be registered only once per process, so the caller must be free to
    load the cached file itself."""
    key = source_hash()
    target = cache_root() / key / LIBRARY_FILE
    if target.exists():
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent.parent, prefix=f".{key}-") as tmp:
        command = [sys.executable, "-m", "kiln.plugins.build", tmp] + (["--verbose"] if verbose else [])
        result = subprocess.run(command, capture_output=not verbose, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the kiln plugins failed:\n{result.stdout}\n{result.stderr}")
        staged = Path(tmp) / "out"
        staged.mkdir()
        shutil.copy2(Path(tmp) / LIBRARY_FILE, staged / LIBRARY_FILE)
        try:
            os.rename(staged, target.parent)
        except OSError:
            if not target.exists():  # another process won the race with the same content
                raise
    return target


def _compile(build_directory: str, verbose: bool) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=LIBRARY_NAME,
        sources=[str(CSRC / "library.cpp")],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(CSRC)],
        build_directory=build_directory,
        is_python_module=False,
        verbose=verbose,
    )


if __name__ == "__main__":
    _compile(sys.argv[1], "--verbose" in sys.argv[2:])
