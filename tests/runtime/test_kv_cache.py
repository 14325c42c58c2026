"""KVCacheManager and Scheduler on their own (no model)."""
import pytest

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
    assert kv.match_prefix(b) == 8 and b.block_table == a_blocks_head(kv, 2)
    c = seq(3, list(range(6)) + [99] * 6)  # diverges inside the second block
    assert kv.match_prefix(c) == 4
    assert kv.blocks[c.block_table[0]].ref_count == 2


def a_blocks_head(kv, count):
    """The blocks holding the first `count` full blocks of range(12), by their hashes."""
    from kiln.runtime.kv_cache import chain_hash

    previous, out = None, []
    for i in range(count):
        previous = chain_hash(previous, tuple(range(i * 4, i * 4 + 4)))
        out.append(kv.by_hash[previous])
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
    assert tail in b.block_table and head not in b.block_table
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
    assert b.status is Status.WAITING and b.block_table == [] and sched.num_preemptions == 1
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
