"""Scheduler: what runs in the next step.

Every step packs decode tokens of running sequences and prefill chunks of waiting ones into
one batch, without padding, under max_num_tokens and max_batch_size. Long prompts spread over
steps (chunked prefill). First come, first served. `prefill_share` (runtime.max_prefill_share)
caps the prefill tokens of a step that also decodes at that share of max_num_tokens, so a
decoding stream's step is never longer than that many prefill rows make it; a step with nothing
to decode takes the whole budget. With `prefill_per_decode` k > 0 (runtime.prefill_per_decode)
a step that decodes d >= `prefill_per_decode_from` streams (runtime.prefill_per_decode_from;
beside fewer, the share) takes at most max(k * d, PREFILL_MIN_CHUNK) prefill tokens, so the
prefill a stream waits on grows with the decode it waits beside (a step costs about its
rows on a CPU: its time stays within about 1 + k steps of decode alone), until the oldest prompt
not yet computed has waited `prefill_max_wait` seconds (runtime.prefill_max_wait): then the
share again, so admission keeps up when prompts come faster than k per decode. When the pool
runs out of blocks the newest running sequence is preempted: its blocks are released and it is
recomputed later (`max_utilization`); `guaranteed_no_evict` admits a request only when the most
blocks it can hold at once (its whole length, prompt + max_tokens; a sliding-window group only
its window's) are left over for it after every running sequence's, so nothing is ever
preempted."""
from __future__ import annotations

import math
import time
from collections import deque

from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.sequence import Sequence, Status

POLICIES = ("max_utilization", "guaranteed_no_evict")
PREFILL_MIN_CHUNK = 16  # prompt tokens a step beside decoding streams may always take (one lanes chunk)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 policy: str = "max_utilization", prefill_share: float = 1.0, prefill_per_decode: float = 0.0,
                 prefill_max_wait: float = 4.0, prefill_per_decode_from: int = 1):
        if policy not in POLICIES:
            raise ValueError(f"scheduler policy {policy!r} is not one of {POLICIES}")
        if not 0 < prefill_share <= 1:
            raise ValueError(f"max_prefill_share must be in (0, 1], got {prefill_share}")
        if not prefill_per_decode >= 0:
            raise ValueError(f"prefill_per_decode must be >= 0 (0: off), got {prefill_per_decode}")
        if not prefill_max_wait >= 0:
            raise ValueError(f"prefill_max_wait must be >= 0 seconds, got {prefill_max_wait}")
        if isinstance(prefill_per_decode_from, bool) or not isinstance(prefill_per_decode_from, int) \
                or prefill_per_decode_from < 1:
            raise ValueError(f"prefill_per_decode_from must be an integer >= 1, got {prefill_per_decode_from!r}")
        self.prefill_share = prefill_share
        self.prefill_per_decode_from = prefill_per_decode_from
        self.prefill_per_decode = prefill_per_decode
        self.prefill_max_wait = prefill_max_wait
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float | None = None) -> list[tuple[Sequence, int]]:
        """[(sequence, number of its tokens to compute this step)]; `now`: time.monotonic()."""
        batch: list[tuple[Sequence, int]] = []
        budget = self.max_num_tokens
        prefill = self._prefill_budget(time.monotonic() if now is None else now)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            count = min(seq.remaining, budget if seq.remaining == 1 else min(budget, prefill))
            if count == 0:
                continue
            while not self.kv.allocate(seq, seq.num_computed + count):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                batch.append((seq, count))
                budget -= count
                if seq.remaining > 1:
                    prefill -= count
        while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not seq.block_tables and not seq.params.return_context_logits:  # those need every row
                self.kv.match_prefix(seq)
            count = min(seq.remaining, budget, prefill)
            if not self._admissible(seq) or not self.kv.allocate(seq, seq.num_computed + count):
                self.kv.release(seq)  # don't sit on matched blocks while waiting
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, count))
            budget -= count
            prefill -= count
        return batch

    def _prefill_budget(self, now: float) -> int:
        """Prefill tokens this step may take (prefill_limit for its decoding streams and the
        oldest prompt not yet computed: the first part-computed one, or the queue's head; a
        preempted sequence goes back to the head with its arrival time)."""
        decodes = sum(seq.remaining == 1 for seq in self.running)
        oldest = min(next((seq.arrival for seq in self.running if seq.remaining > 1), math.inf),
                     self.waiting[0].arrival if self.waiting else math.inf)
        return self.prefill_limit(decodes, now - oldest if oldest < math.inf else 0.0)

    def prefill_limit(self, decodes: int, waited: float = 0.0) -> int:
        """Prefill tokens a step that decodes `decodes` streams may take, the oldest prompt not
        yet computed having waited `waited` seconds: all the budget when nothing decodes, else
        the share, or with prefill_per_decode k per decoding stream (from prefill_per_decode_from
        decoding streams on) until the wait limit."""
        if not decodes:
            return self.max_num_tokens
        cap = max(1, int(self.prefill_share * self.max_num_tokens))
        if self.prefill_per_decode <= 0 or decodes < self.prefill_per_decode_from or waited >= self.prefill_max_wait:
            return cap
        return min(cap, max(math.ceil(self.prefill_per_decode * decodes), PREFILL_MIN_CHUNK))

    def _admissible(self, seq: Sequence) -> bool:
        if self.policy != "guaranteed_no_evict":
            return True
        kv, step = self.kv, self.max_num_tokens
        reserved = sum(max(kv.peak_blocks(s.max_total_len, step) - kv.held_blocks(s), 0) for s in self.running)
        needed = kv.peak_blocks(seq.max_total_len, step) - kv.held_blocks(seq)
        return needed <= kv.num_free_blocks - reserved

    def preempt(self, seq: Sequence) -> None:
        """Release its blocks and queue it first in line, to be recomputed from its tokens."""
        self.kv.release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        self.kv.release(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
