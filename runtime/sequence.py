"""Sequence: one request's state inside the runtime."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kiln.runtime.sampling import Sampler, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    token_ids: list[int] = field(init=False)  # prompt, then generated tokens
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose keys/values are in the cache
    # one block table per group of layers (kv_layout), all of one length; empty without blocks
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, in order
    # per group: its first this many blocks fell out of the group's sliding window and were
    # released (their ids stay in the table, never read again: attention skips them)
    released_blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    context_logits: torch.Tensor | None = None  # [prompt, vocab], when the request asks for them
    deadline: float | None = None  # time.monotonic() at which it ends ("timeout") if still live
    arrival: float = field(default_factory=time.monotonic)  # time.monotonic() when it was made

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)
        self.sampler = Sampler(self.params)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def max_total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def remaining(self) -> int:
        """Tokens to run through the model before the next sample."""
        return len(self.token_ids) - self.num_computed
