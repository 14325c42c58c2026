"""Accuracy measurement: perplexity of an engine (or of the unquantized checkpoint beside it)
on any text, by the usual sliding-window method (windows of the engine's max_input_len,
moved by `stride`; each token is scored once, with up to a window of context)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.runtime.model import KVPool, LlamaModel, StepContext


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int


def window_logits(model: LlamaModel, ids: list[int], block_size: int) -> torch.Tensor:
    """Float32 logits at every position of one window, through a private block pool."""
    blocks = -(-len(ids) // block_size)
    pool = KVPool(model.spec, blocks, block_size, model.kv_dtype)
    ctx = StepContext.single(0, len(ids), list(range(blocks)), all_logits=True)
    return model.forward(torch.tensor(ids), ctx, pool)


def perplexity(model: LlamaModel, ids: list[int], window: int, stride: int, block_size: int = 32,
               progress=lambda done, total: None) -> Perplexity:
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    total_nll, scored, windows, previous_end = 0.0, 0, 0, 0
    starts = list(range(0, len(ids), stride))
    for begin in starts:
        end = min(begin + window, len(ids))
        first_target = max(previous_end, begin + 1)  # tokens before it were scored already
        if first_target < end:
            logits = window_logits(model, ids[begin:end], block_size)
            rows = logits[first_target - begin - 1 : end - begin - 1]
            targets = torch.tensor(ids[first_target:end])
            total_nll += torch.nn.functional.cross_entropy(rows, targets, reduction="sum").item()
            scored += end - first_target
            windows += 1
        previous_end = end
        progress(windows, len(starts))
        if end == len(ids):
            break
    nll = total_nll / scored
    return Perplexity(math.exp(nll), nll, scored, windows)
