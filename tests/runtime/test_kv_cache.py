"""KVCacheManager and Scheduler on their own (no model), and the memory the KV pool lies in."""
import sys

import pytest
import torch

from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence, Status


def seq(request_id, tokens, max_tokens=4):
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), frozenset())


def test_prefix_match_takes_only_full_blocks_before_the_last_token():
    kv = KVCacheManager(10, 4)
    a = seq(1, range(12))
    assert kv.allocate(a, 12)
    a.num_computed = 12
    kv.register_full_blocks(a)
    kv.release(a)
    assert kv.num_free_blocks == 10
    b = seq(2, range(12))  # the same 12 tokens: the last block is recomputed, not shared
    assert kv.match_prefix(b) == 8 and b.block_tables == [a_blocks_head(kv, 2)]
    c = seq(3, list(range(6)) + [99] * 6)  # diverges inside the second block
    assert kv.match_prefix(c) == 4
    assert kv.blocks[c.block_tables[0][0]].ref_count == 2


def a_blocks_head(kv, count):
    """The blocks holding the first `count` full blocks of range(12), by their hashes."""
    from kiln.runtime.kv_cache import chain_hash

    previous, out = None, []
    for i in range(count):
        previous = chain_hash(previous, tuple(range(i * 4, i * 4 + 4)))
        out.append(kv.by_hash[(0, previous)])
    return out


def test_released_hashed_blocks_are_evicted_least_recent_first():
    kv = KVCacheManager(4, 2)
    a = seq(1, [1, 2, 3, 4])
    kv.allocate(a, 4)
    a.num_computed = 4
    kv.register_full_blocks(a)
    kv.release(a)  # both blocks cached, tail first in eviction order
    head, tail = kv.by_hash.values()
    b = seq(2, [9] * 6)
    assert kv.allocate(b, 6)  # 2 free + 1 evicted
    assert tail in b.block_tables[0] and head not in b.block_tables[0]
    assert list(kv.by_hash.values()) == [head]


def test_prefix_reuse_off_never_shares():
    kv = KVCacheManager(8, 2, enable_prefix_reuse=False)
    a = seq(1, [1, 2, 3, 4, 5])
    kv.allocate(a, 5)
    a.num_computed = 5
    kv.register_full_blocks(a)
    assert kv.by_hash == {} and kv.match_prefix(seq(2, [1, 2, 3, 4, 5])) == 0


def test_scheduler_packs_decode_and_prefill_chunks_under_the_token_budget():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, max_batch_size=8, max_num_tokens=10)
    a, b, c = seq(1, range(3)), seq(2, range(20)), seq(3, range(5))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [(1, 3), (2, 7)]  # b is chunked, c waits
    for s, n in batch:
        s.num_computed += n
    a.token_ids.append(7)  # a sampled a token: it decodes next
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [(1, 1), (2, 9)]


def run_step(batch) -> None:
    """What the executor does with a step: compute the tokens, sample where a prompt is done."""
    for s, n in batch:
        s.num_computed += n
        if s.remaining == 0:
            s.token_ids.append(1)


def test_sixteen_prompts_at_once_all_get_a_first_token_before_any_gets_a_tenth():
    """FCFS chunks under the token budget, decodes first: with 16 prompts of 100 tokens and 256
    tokens a step, the last prompt's first token comes within 7 steps of the first's."""
    kv = KVCacheManager(1024, 16)
    sched = Scheduler(kv, max_batch_size=16, max_num_tokens=256)
    prompts = [seq(i, range(100), max_tokens=64) for i in range(16)]
    for s in prompts:
        sched.add(s)
    while any(s.num_generated == 0 for s in prompts):
        run_step(sched.schedule())
    most = max(s.num_generated for s in prompts)
    assert most < 10, [s.num_generated for s in prompts]


def test_prefill_share_caps_prefill_beside_decoding_streams_only():
    kv = KVCacheManager(256, 4)
    sched = Scheduler(kv, max_batch_size=8, max_num_tokens=64, prefill_share=0.25)
    first, second = seq(1, range(100)), seq(2, range(100))
    sched.add(first)
    batch = sched.schedule()  # nothing decodes: the whole budget
    assert [(s.request_id, n) for s, n in batch] == [(1, 64)]
    run_step(batch)
    run_step(sched.schedule())  # first's last 36 prompt tokens: it samples and decodes next
    sched.add(second)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [(1, 1), (2, 16)]  # 0.25 x 64 beside a decode
    with pytest.raises(ValueError, match="max_prefill_share must be in"):
        Scheduler(kv, max_batch_size=8, max_num_tokens=64, prefill_share=0)


@pytest.mark.parametrize("streams, chunk", [(4, 16), (20, 40), (50, 64)])
def test_prefill_per_decode_grows_with_the_decoding_streams_until_a_prompt_waits_too_long(streams, chunk):
    """k = 2 prompt tokens per decoding stream, at least PREFILL_MIN_CHUNK (16), at most the share
    (0.25 x 256 = 64); once the prompt has waited prefill_max_wait (5 s), the share."""
    kv = KVCacheManager(1024, 4)
    sched = Scheduler(kv, max_batch_size=64, max_num_tokens=256, prefill_share=0.25, prefill_per_decode=2.0,
                      prefill_max_wait=5.0)
    decoders = [seq(i, range(2), max_tokens=100) for i in range(streams)]
    for s in decoders:
        s.arrival = 0.0
        sched.add(s)
    run_step(sched.schedule(now=0.0))  # nothing decodes yet: every 2-token prompt in one step
    assert all(s.num_generated == 1 for s in decoders)
    prompt = seq(99, range(200))
    prompt.arrival = 10.0
    sched.add(prompt)
    batch = sched.schedule(now=12.0)
    assert [(s.request_id, n) for s, n in batch] == [(s.request_id, 1) for s in decoders] + [(99, chunk)]
    run_step(batch)
    batch = sched.schedule(now=15.0)  # it has waited 5 s and is not yet computed: the share
    assert batch[-1] == (prompt, 64) and len(batch) == streams + 1


@pytest.mark.parametrize("streams, chunk", [(3, 64), (7, 64), (8, 16), (12, 24)])
def test_prefill_per_decode_applies_only_from_its_number_of_decoding_streams(streams, chunk):
    """prefill_per_decode_from = 8: beside fewer decoding streams a prompt takes the share
    (0.25 x 256 = 64) as without the rule; from 8 on, max(k x streams, 16) with k = 2."""
    kv = KVCacheManager(1024, 4)
    sched = Scheduler(kv, max_batch_size=64, max_num_tokens=256, prefill_share=0.25, prefill_per_decode=2.0,
                      prefill_max_wait=5.0, prefill_per_decode_from=8)
    assert [sched.prefill_limit(d) for d in (1, 7, 8, 20, 40)] == [64, 64, 16, 40, 64]
    decoders = [seq(i, range(2), max_tokens=100) for i in range(streams)]
    for s in decoders:
        s.arrival = 0.0
        sched.add(s)
    run_step(sched.schedule(now=0.0))
    prompt = seq(99, range(200))
    prompt.arrival = 1.0
    sched.add(prompt)
    batch = sched.schedule(now=1.5)
    assert [(s.request_id, n) for s, n in batch] == [(s.request_id, 1) for s in decoders] + [(99, chunk)]


def test_prefill_per_decode_and_wait_must_be_non_negative():
    kv = KVCacheManager(16, 4)
    with pytest.raises(ValueError, match="prefill_per_decode must be >= 0"):
        Scheduler(kv, max_batch_size=8, max_num_tokens=64, prefill_per_decode=-1)
    with pytest.raises(ValueError, match="prefill_max_wait must be >= 0"):
        Scheduler(kv, max_batch_size=8, max_num_tokens=64, prefill_per_decode=1, prefill_max_wait=float("nan"))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="prefill_per_decode_from must be an integer >= 1"):
            Scheduler(kv, max_batch_size=8, max_num_tokens=64, prefill_per_decode=1, prefill_per_decode_from=bad)


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    kv = KVCacheManager(4, 2)
    sched = Scheduler(kv, max_batch_size=8, max_num_tokens=100)
    a, b = seq(1, range(4)), seq(2, range(4))
    sched.add(a)
    sched.add(b)
    assert len(sched.schedule()) == 2
    for s in (a, b):
        s.num_computed = 4
        s.token_ids.append(1)
    batch = sched.schedule()  # a needs a third block: b (newest) is preempted
    assert [s.request_id for s, _ in batch] == [1]
    assert b.status is Status.WAITING and b.block_tables == [] and sched.num_preemptions == 1
    assert sched.waiting[0] is b


def test_guaranteed_no_evict_reserves_whole_requests():
    kv = KVCacheManager(6, 2)
    sched = Scheduler(kv, max_batch_size=8, max_num_tokens=100, policy="guaranteed_no_evict")
    a, b = seq(1, range(4), max_tokens=4), seq(2, range(2), max_tokens=4)  # 4 and 3 blocks in all
    sched.add(a)
    sched.add(b)
    assert [s.request_id for s, _ in sched.schedule()] == [1]  # b would not fit beside a's reserve


def test_unknown_policy():
    with pytest.raises(ValueError, match="guaranteed_no_evict"):
        Scheduler(KVCacheManager(1, 1), 1, 1, policy="fastest")


def run_steps(kv, s, steps):
    """Decode `steps` tokens of a sequence whose prompt is computed, as the executor does."""
    for _ in range(steps):
        s.token_ids.append(7)
        assert kv.allocate(s, len(s.token_ids))
        s.num_computed = len(s.token_ids)
        kv.register_full_blocks(s)
        kv.release_behind_window(s)


def test_a_sliding_window_group_holds_only_its_window():
    """A global group and a window-5 group, blocks of 2: after 40 tokens the global table holds all
    20 blocks, the window's only the blocks from position 36 on; the pool gets every one back."""
    kv = KVCacheManager(40, 2, enable_prefix_reuse=False, windows=(0, 5))
    s = seq(1, range(10))
    assert kv.allocate(s, 10)
    s.num_computed = 10
    kv.release_behind_window(s)
    run_steps(kv, s, 30)
    assert [len(t) for t in s.block_tables] == [20, 20]
    assert s.released_blocks == [0, 18]  # the next token (position 40) attends from 36: blocks 18, 19
    assert kv.held_blocks(s) == 22 == kv.num_blocks - kv.num_free_blocks
    assert kv.peak_used <= kv.peak_blocks(40, 1) == 20 + 4
    kv.release(s)
    assert kv.num_free_blocks == 40 and s.block_tables == [] and s.released_blocks == []


def cached_then_squeezed(filler_tokens):
    """A window-3 group beside a global one, blocks of 2: a 12-token sequence computed and released
    (every block hashed), then `filler_tokens` other tokens allocated, which evicts the least
    recently released blocks: the window group's oldest first."""
    kv = KVCacheManager(16, 2, windows=(0, 3))
    a = seq(1, range(12))
    assert kv.allocate(a, 12)
    a.num_computed = 12
    kv.register_full_blocks(a)
    kv.release_behind_window(a)
    assert a.released_blocks == [0, 5]
    kv.release(a)
    assert kv.num_free_blocks == 16 and len(kv.by_hash) == 12
    assert kv.allocate(seq(2, [99] * filler_tokens), filler_tokens)
    return kv


def test_prefix_reuse_needs_only_the_blocks_the_window_reaches():
    """The window group's 4 oldest blocks were evicted: the prefix still matches, as the next
    token (position 10: the last is recomputed) attends within the window from position 8 on,
    block 4, which is cached; the global group shares all 5 blocks."""
    kv = cached_then_squeezed(7)
    assert sorted(group for group, _ in kv.by_hash) == [0] * 6 + [1] * 2  # the window's blocks 4, 5 left
    b = seq(3, range(12))
    assert kv.match_prefix(b) == 10
    assert b.block_tables[0] == [kv.by_hash[(0, key)] for key in b.block_hashes]
    assert b.released_blocks == [0, 4] and b.block_tables[1][4] == kv.by_hash[(1, b.block_hashes[4])]
    assert kv.held_blocks(b) == 6 and all(kv.blocks[i].ref_count == 1 for i in b.block_tables[0])


def test_prefix_reuse_stops_where_the_window_group_lost_a_block_it_needs():
    kv = cached_then_squeezed(10)  # evicts the window group's blocks 0-4 (and the global block 5)
    b = seq(3, range(12))
    assert kv.match_prefix(b) == 0 and b.block_tables == []


def test_guaranteed_no_evict_reserves_a_window_groups_window_only():
    """Requests of 40 tokens, blocks of 2, steps of up to 16 tokens: 20 blocks in the global group,
    at most 11 in a window-4 group (not 20), so two fit in 64 blocks, a third does not."""
    kv = KVCacheManager(64, 2, windows=(0, 4))
    sched = Scheduler(kv, max_batch_size=8, max_num_tokens=16, policy="guaranteed_no_evict")
    assert kv.peak_blocks(40, 16) == 20 + 11
    requests = [seq(i, range(8), max_tokens=32) for i in (1, 2, 3)]
    for s in requests[:2]:
        sched.add(s)
    batch = sched.schedule()
    assert [(s.request_id, n) for s, n in batch] == [(1, 8), (2, 8)]
    for s, n in batch:
        s.num_computed += n
        s.token_ids.append(5)
    sched.add(requests[2])
    assert [(s.request_id, n) for s, n in sched.schedule()] == [(1, 1), (2, 1)]
    assert requests[2].status is Status.WAITING


def vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping holding address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_the_kv_pools_memory_is_advised_for_huge_pages_and_holds_what_is_written(dtype):
    from kiln.runtime.model import empty_in_huge_pages

    shape = (2, 2, 37, 3, 16, 64)  # not a whole number of 2 MB pages
    pool = empty_in_huge_pages(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert "hg" in vm_flags_of(pool.data_ptr()), "the pool's mapping is not advised for huge pages (MADV_HUGEPAGE)"
    values = torch.randint(-100, 100, shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    pool.copy_(values)
    view = pool[1, 0]  # as KVPool takes each layer's keys
    del pool
    assert torch.equal(view, values[1, 0])  # the region outlives the tensor it was made for
