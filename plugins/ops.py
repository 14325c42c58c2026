"""Loading the plugin library and the fake (meta) implementations of its ops.

The ops are C++ `TORCH_LIBRARY(kiln, ...)` ops so a fresh process (tritonserver's Python
stub, an AOTInductor package) finds them after `load_library`. Fake implementations give
shapes and strides without computing, for tracing and export."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_loaded: dict[str, str] = {}  # sha256 of the library file -> path it was loaded from


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_library(path: str | Path) -> None:
    """Load a compiled plugin library once per process.

    The `kiln` op namespace can be registered only once, so a second, different library in the
    same process is an error rather than a silent mix of kernels."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"plugin library {path} is missing")
    digest = _sha256(path)
    if digest in _loaded:
        return
    if _loaded:
        raise RuntimeError(
            f"a different kiln plugin library is already loaded in this process "
            f"({next(iter(_loaded.values()))}); serve engines built by one kiln version per process"
        )
    torch.ops.load_library(str(path))
    _register_fakes()
    _loaded[digest] = str(path)


def _register_fakes() -> None:
    @torch.library.register_fake("kiln::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kiln::paged_attention")
    def _paged_attention_fake(q, k, v, k_pool, v_pool, block_tables, query_start, context_lens, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def select_isa(isa: str) -> str:
    """Switch every kernel to one instruction set ('auto', 'avx512', 'avx2', 'scalar')."""
    return torch.ops.kiln.select_isa(isa)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.kiln.rms_norm(x, weight, eps)


def paged_attention(q, k, v, k_pool, v_pool, block_tables, query_start, context_lens, scale: float):
    """Write the new tokens' k/v into their pool slots, then causal GQA attention of each new
    token over its sequence's blocks (see csrc/attention.h for the layout)."""
    return torch.ops.kiln.paged_attention(q, k, v, k_pool, v_pool, block_tables, query_start,
                                          context_lens, scale)
