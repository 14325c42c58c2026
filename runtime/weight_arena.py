"""A loaded model's weights in one allocation of 2 MB pages, in the order a decode step reads them.

A decode step streams every linear's weight once, so the weights sit in 2 MB pages (few TLB
entries for the stream). Given pages of its own, each weight is rounded up to whole 2 MB pages:
a 166 KB int4 projection holds 2 MB, and SmolLM2's int4_awq engine, 133 MB of tensors, grows the
process by 494 MB loaded that way (Engine(..., weight_arena=False)), by 179 MB in the arena
(docs/benchmarks.md). The arena lays the weights end to end in step order (each layer's qkv,
out, gate_up, down, experts; then the output projection), so the kernels' software prefetch, a
few KB ahead of what they read, runs on from one GEMV's last bytes into the next one's first
(no change in decode speed measured on SmolLM2). The embedding table follows (tied to the output
projection, it is that tensor, placed once). Scales, biases and norms stay where they are:
small, read beside the weights."""
from __future__ import annotations

import ctypes

import torch

from kiln.plugins import ops

ALIGN = 64  # bytes: every weight starts on a cache line


def streamed(model) -> list[tuple[object, str]]:
    """(owner, attribute) of every tensor the arena holds, in the order a decode step reads them."""
    places = [(linear, linear.streamed_attr) for layer in model.layers for linear in layer.linears().values()]
    return places + [(model.lm_head, model.lm_head.streamed_attr), (model, "embed")]


def place_weights(model) -> int:
    """Copy every tensor of streamed(model) into one arena of 2 MB pages and point its owner at
    the copy (a tensor that two owners share is copied once); returns the arena's bytes. The old
    tensors are freed once nothing else holds them (return_freed_memory gives their pages back)."""
    places = streamed(model)

    def key(t: torch.Tensor) -> tuple:  # the same tensor, whichever owner holds it
        return t.data_ptr(), tuple(t.shape), t.dtype

    def span(t: torch.Tensor) -> int:  # its bytes in the arena, up to the next weight's start
        return -(-t.nbytes // ALIGN) * ALIGN

    tensors: dict[tuple, torch.Tensor] = {}  # each tensor once, in step order
    for owner, attr in places:
        t = getattr(owner, attr)
        tensors.setdefault(key(t), t)
    total = sum(span(t) for t in tensors.values())
    # one 2 MB-aligned allocation advised for huge pages (ops.to_hugepages of an untouched buffer:
    # its pages are never written, so reading them costs no memory)
    arena = ops.to_hugepages(torch.empty(total, dtype=torch.uint8))
    start = 0
    for k, t in tensors.items():
        tensors[k] = arena[start:start + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        start += span(t)
    for owner, attr in places:
        setattr(owner, attr, tensors[key(getattr(owner, attr))])
    return total


def apart(model) -> None:
    """The layout before the arena, for comparisons (Engine(..., weight_arena=False)): each tiled
    int4 / int8 / bf16 weight (which the packers leave in ordinary memory) in 2 MB pages of its own,
    rounded up to whole pages; the loader gives the other weights of 1 MB or more theirs."""
    for owner, attr in streamed(model):
        if getattr(owner, "tiled", False):
            setattr(owner, attr, ops.to_hugepages(getattr(owner, attr)))


def return_freed_memory() -> None:
    """Give the pages of freed memory back to the system (glibc's malloc_trim; elsewhere nothing):
    the weights' earlier copies were freed inside malloc's heap, which keeps them otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
