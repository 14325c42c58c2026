"""In-flight batching: many requests at once give exactly what each gives alone, under
preemption, cancellation and prefix reuse, and leave the pool empty."""
import random
import threading

import pytest

from kiln.errors import RequestError
from kiln.runtime.sampling import SamplingParams

MAX_INPUT = 256


def random_requests(seed: int, count: int, vocab: int = 384):
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.choice([1, 2, 15, 16, 17, rng.randint(1, MAX_INPUT)])
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        requests.append((prompt, rng.randint(1, 40)))
    return requests


def run_alone(llm, requests):
    return [llm.generate(prompt, max_tokens=n).token_ids for prompt, n in requests]


def run_together(llm, requests):
    """Start every stream before reading any, so all are in the executor at once."""
    streams = [llm.stream(prompt, max_tokens=n) for prompt, n in requests]
    return [[t for chunk in stream for t in chunk.token_ids] for stream in streams]


def assert_pool_empty(llm):
    stats = llm.stats()
    assert stats["blocks_free"] == stats["blocks_total"], stats
    assert stats["running"] == 0 and stats["queued"] == 0
    assert all(block.ref_count == 0 for block in llm.executor.kv.blocks)


@pytest.fixture(scope="module")
def alone(batch_engine, llm_for):
    llm = llm_for(batch_engine, enable_prefix_reuse=False)
    requests = random_requests(0, 64)
    return requests, run_alone(llm, requests)


def test_64_concurrent_requests_equal_each_alone(batch_engine, llm_for, alone):
    requests, expected = alone
    llm = llm_for(batch_engine)
    before = llm.stats()["steps"]
    assert run_together(llm, requests) == expected
    stats = llm.stats()
    # batched: far fewer steps than the requests' tokens would take one at a time
    assert stats["steps"] - before < sum(n for _, n in requests) / 4
    assert_pool_empty(llm)


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_small_pool_preempts_and_outputs_are_unchanged(batch_engine, llm_for, alone, policy):
    requests, expected = alone
    # 40 blocks of 16 tokens: room for a max_seq_len sequence and little more
    llm = llm_for(batch_engine, kv_cache_memory="320KiB", scheduler=policy, enable_prefix_reuse=False)
    assert llm.stats()["blocks_total"] == 40
    assert run_together(llm, requests[:24]) == expected[:24]
    stats = llm.stats()
    if policy == "max_utilization":
        assert stats["preemptions"] > 0
    else:
        assert stats["preemptions"] == 0
    assert_pool_empty(llm)


def test_cancelling_half_mid_stream_frees_their_blocks(batch_engine, llm_for, alone):
    requests, expected = alone
    llm = llm_for(batch_engine)
    long_ones = [(p, 40) for p, _ in requests[:16]]
    want = run_alone(llm, long_ones)
    streams = [llm.stream(p, max_tokens=n, ignore_eos=True) for p, n in long_ones]
    firsts = [next(s) for s in streams]  # every request is running now
    for stream in streams[::2]:
        stream.close()  # cancels the request
    for i in range(1, 16, 2):
        tokens = firsts[i].token_ids + [t for chunk in streams[i] for t in chunk.token_ids]
        assert len(tokens) == 40
        if want[i] and len(want[i]) == 40:  # the same as alone unless alone stopped at an end id
            assert tokens == want[i]
    assert llm.stats()["requests_finished"] >= 16
    assert_pool_empty(llm)


def test_shared_prefix_reuses_blocks_with_identical_output(batch_engine, llm_for):
    rng = random.Random(5)
    prefix = [rng.randrange(3, 384) for _ in range(200)]
    requests = [(prefix + [rng.randrange(3, 384) for _ in range(rng.randint(1, 30))], 20) for _ in range(12)]
    without = llm_for(batch_engine, enable_prefix_reuse=False)
    expected = run_together(without, requests)
    with_reuse = llm_for(batch_engine, enable_prefix_reuse=True, max_queue_size=255)
    with_reuse.generate(requests[0][0], max_tokens=1)  # puts the prefix's blocks in the cache
    assert run_together(with_reuse, requests) == expected
    stats = with_reuse.stats()
    assert stats["prefix_hit_rate"] > 0.5 and stats["blocks_reused"] >= 12 * (200 // 16)
    assert without.stats()["blocks_reused"] == 0
    assert_pool_empty(with_reuse)


def test_full_queue_answers_busy_and_keeps_serving(batch_engine, llm_for):
    llm = llm_for(batch_engine, max_queue_size=2)
    executor = llm.executor
    ids = [executor.enqueue([5, 6, 7], SamplingParams(max_tokens=30)) for _ in range(40)]
    errors, finished = [], 0
    for request_id in ids:
        done = False
        while not done:
            for response in executor.await_responses(request_id, timeout=60):
                done = response.finished
                if response.error:
                    errors.append(response.error)
                elif done:
                    finished += 1
    assert errors and all(e.startswith("busy") for e in errors)
    assert finished >= 2 and finished + len(errors) == 40
    assert llm.generate([5, 6, 7], max_tokens=3).token_ids  # still serving
    assert_pool_empty(llm)


def test_requests_over_the_limits_are_refused(batch_engine, llm_for):
    llm = llm_for(batch_engine)
    executor = llm.executor
    with pytest.raises(RequestError, match="max_input_len 256"):
        executor.enqueue([1] * (MAX_INPUT + 1), SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="max_seq_len 512"):
        llm.generate([1] * 200, max_tokens=400)


def test_threads_share_the_executor(batch_engine, llm_for, alone):
    """Callers on many threads at once (as a server has) get their own answers."""
    requests, expected = alone
    llm = llm_for(batch_engine)
    results = [None] * 16

    def worker(i):
        prompt, n = requests[i]
        results[i] = llm.generate(prompt, max_tokens=n).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected[:16]


def test_pool_too_small_for_one_sequence_is_refused(batch_engine):
    from kiln.errors import ConfigError
    from kiln.runtime.llm import LLM

    with pytest.raises(ConfigError, match=r"runtime.kv_cache_memory '64KiB' holds 8 blocks .* needs \(32"):
        LLM(batch_engine, kv_cache_memory="64KiB")


def resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("reserve", [True, False])
def test_the_pool_is_resident_from_load_when_reserved(batch_engine, reserve):
    """kv_cache_reserve writes the whole pool at load (memory as under load from the start);
    without it, a pool no sequence has used yet costs next to nothing."""
    import gc

    from kiln.runtime.llm import LLM

    gc.collect()
    before = resident_bytes()
    llm = LLM(batch_engine, kv_cache_memory="256MiB", kv_cache_reserve=reserve)
    try:
        grown, pool = resident_bytes() - before, llm.executor.pool.storage.nbytes
        assert pool > 250 * 2**20
        if reserve:
            assert grown >= 0.95 * pool, (grown, pool)
        else:
            assert grown < 0.25 * pool, (grown, pool)
    finally:
        llm.close()


def test_a_pool_over_available_memory_is_refused_at_load(batch_engine):
    from kiln.errors import ConfigError
    from kiln.runtime.llm import LLM

    with pytest.raises(ConfigError, match=r"runtime.kv_cache_memory '64TiB' is [\d.]+ GiB of KV blocks, more than "
                                          r"the [\d.]+ GiB this machine has available"):
        LLM(batch_engine, kv_cache_memory="64TiB")


def test_pool_sized_from_a_fraction_of_free_memory(batch_engine, llm_for):
    from kiln.runtime.options import available_memory

    llm = llm_for(batch_engine, kv_cache_memory=0.001)
    expected = int(0.001 * available_memory()) // 8192
    assert abs(llm.stats()["blocks_total"] - expected) <= expected * 0.2 + 8


def test_a_request_whose_sampling_fails_fails_alone(batch_engine, llm_for):
    """Every token banned (an embedding bias of -inf everywhere) leaves nothing to draw from: that
    request gets an error, the one sampled in the same steps finishes as usual."""
    llm = llm_for(batch_engine)
    banned = (float("-inf"),) * llm.engine.spec.vocab_size
    bad = llm.stream([5, 6, 7], max_tokens=8, temperature=1.0, embedding_bias=banned)
    good = llm.stream([5, 6, 7, 8], max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    with pytest.raises(RequestError, match="sampling failed"):
        list(bad)
    assert sum(len(chunk.token_ids) for chunk in good) == 8
    assert_pool_empty(llm)


@pytest.mark.parametrize("values", [{"presence_penalty": float("nan")}, {"temperature": float("inf")},
                                    {"frequency_penalty": float("-inf")}, {"top_p": float("nan")},
                                    {"repetition_penalty": float("nan")}])
def test_sampling_values_that_are_not_numbers_are_refused(values):
    with pytest.raises(RequestError, match="must be a finite number"):
        SamplingParams(**values)


def test_a_bias_of_nan_is_refused_and_a_tiny_temperature_is_greedy():
    with pytest.raises(RequestError, match="embedding_bias"):
        SamplingParams(embedding_bias=(0.0, float("nan")))
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=0.5).greedy


def test_queued_count_falls_to_zero_when_waiting_requests_are_cancelled(batch_engine, llm_for):
    """Cancelled requests that never ran leave no step behind to recount the queue: the count (a
    Triton gauge) must still fall to zero."""
    llm = llm_for(batch_engine)
    executor = llm.executor
    ids = [executor.enqueue([7] * 250, SamplingParams(max_tokens=50)) for _ in range(40)]  # one prefill a step
    for request_id in ids:
        executor.cancel(request_id)
    for request_id in ids:
        while not any(r.finished for r in executor.await_responses(request_id, timeout=30)):
            pass
    stats = executor.stats()
    assert stats["queued"] == 0 and stats["running"] == 0
    assert_pool_empty(llm)


QUICK_BUILD = {"calibration": {"samples": 8, "seq_len": 64}, "accuracy": {"tokens": 512, "window": 128},
               "accuracy_gate": None}


@pytest.mark.parametrize("dtype, quantization", [
    ("bfloat16", {"algo": "none"}),
    ("bfloat16", {"algo": "int8_wo"}),
    ("bfloat16", {"algo": "int4_awq", "group_size": 32, "lm_head": "int4"}),
    ("bfloat16", {"algo": "w4a8_awq", "group_size": 32}),
    ("bfloat16", {"algo": "int8_sq", "kv_cache": "int8"}),
    ("bfloat16", {"algo": "fp8", "kv_cache": "fp8"}),
    ("float32", {"algo": "int4_wo", "group_size": 32}),
])
def test_64_concurrent_requests_are_the_bits_of_each_alone_for_every_kind(dtype, quantization, tiny_models, tmp_path):
    """Batch invariance (runtime.batch_invariant, the default): every linear takes one route at
    every row count, and kiln's kernels give each row the bits it gets alone, so 64 requests in
    flight together (steps of up to 64 decodes and 256-token prefill chunks) give each request the
    tokens it gets alone: bf16, and every quantized kind."""
    from tests.helpers import build_engine
    from kiln.runtime.llm import LLM

    engine = build_engine(tmp_path / "e", tiny_models["llama"], dtype, quantization={**quantization, **QUICK_BUILD},
                          max_batch_size=64, max_num_tokens=256, max_input_len=256, max_seq_len=512,
                          kv_block_size=16)
    requests = random_requests(1, 64)
    llm = LLM(engine, enable_prefix_reuse=False)
    try:
        expected = run_alone(llm, requests)
        before = llm.stats()["steps"]
        got = run_together(llm, requests)
        differ = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
        assert not differ, f"requests {differ} differ from their tokens alone"
        assert llm.stats()["steps"] - before < sum(n for _, n in requests) / 4  # batched
    finally:
        llm.close()


@pytest.mark.parametrize("interval", [3, 8])
def test_stream_interval_sends_tokens_in_bursts_and_loses_none(batch_engine, llm_for, alone, interval):
    """runtime.stream_interval N, 64 requests in flight: each request's first token comes in a
    response of its own, later ones N a response, and its final response carries what is left
    (fewer than N held, plus the last); the tokens are those it gets alone, with their log probs."""
    requests, expected = alone
    llm = llm_for(batch_engine, stream_interval=interval)
    executor = llm.executor
    ids = [executor.enqueue(prompt, SamplingParams(max_tokens=n, return_log_probs=True)) for prompt, n in requests]
    for request_id, want in zip(ids, expected):
        responses = []
        while not (responses and responses[-1].finished):
            responses += executor.await_responses(request_id)
        sizes = [len(r.token_ids) for r in responses]
        assert [t for r in responses for t in r.token_ids] == want, (request_id, sizes)
        assert all(len(r.log_probs) == len(r.token_ids) for r in responses), (request_id, sizes)
        assert all(not r.finished for r in responses[:-1]), (request_id, sizes)
        if len(want) > 1:
            assert sizes[0] == 1 and all(size == interval for size in sizes[1:-1]), (request_id, sizes)
            assert len(responses) == 2 + (len(want) - 2) // interval or sizes[-1] == 0, (request_id, sizes)
            assert sizes[-1] <= interval, (request_id, sizes)  # fewer than N held, and the last token
    assert_pool_empty(llm)


def test_stream_interval_tokens_held_at_a_cancel_are_sent_with_the_end(batch_engine, llm_for):
    """A request cancelled while tokens wait for their burst gets them in its final response."""
    llm = llm_for(batch_engine, stream_interval=1000)
    executor = llm.executor
    before = executor.stats()["tokens_generated"]
    max_tokens = 509  # the engine's max_seq_len less the prompt: time to cancel on a fast host
    request_id = executor.enqueue([5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first = executor.await_responses(request_id)
    assert [len(r.token_ids) for r in first] == [1] and not first[0].finished
    while executor.stats()["tokens_generated"] < before + 6:  # held: no response until the end
        assert executor.await_responses(request_id, timeout=0.002) == []
    executor.cancel(request_id)
    rest = []
    while not (rest and rest[-1].finished):
        rest += executor.await_responses(request_id)
    assert len(rest) == 1 and rest[0].finish_reason == "cancelled", rest
    assert 5 <= len(rest[0].token_ids) < max_tokens


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4"])
def test_a_stream_interval_that_is_not_a_positive_integer_is_refused(batch_engine, value):
    from kiln.runtime.llm import LLM

    with pytest.raises(ValueError, match=r"stream_interval must be an integer >= 1 \(tokens a response\), got "):
        LLM(batch_engine, stream_interval=value)


def test_step_log_has_a_line_for_every_step(batch_engine, tmp_path):
    """runtime.step_log: a JSON line a step whose counts add up to the executor's own, prefill
    and decode told apart (16 prompts of 17 tokens, 5 new tokens each, all at once)."""
    import json

    from kiln import constants as names
    from kiln.runtime.llm import LLM

    path = tmp_path / "steps.jsonl"
    path.write_text("")  # appended to, not replaced
    llm = LLM(batch_engine, step_log=str(path), enable_prefix_reuse=False)
    try:
        requests = [([3 + (7 * i + j) % 300 for j in range(17)], 5) for i in range(16)]
        run_together(llm, requests)
        stats = llm.stats()
    finally:
        llm.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == stats["steps"] > 0
    assert all(list(line) == list(names.STEP_LOG_FIELDS) for line in lines)
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert sum(line["tokens"] for line in lines) == stats["tokens_computed"] == 16 * (17 + 4)
    # every generated token but each request's first (sampled from its prompt's last step)
    assert sum(line["decode_tokens"] for line in lines) == 16 * 4
    assert all(line["ms"] > 0 and 1 <= line["sequences"] <= line["tokens"] for line in lines)
    assert [line["time"] for line in lines] == sorted(line["time"] for line in lines)


def test_a_step_log_that_cannot_be_opened_is_refused_at_load(batch_engine, tmp_path):
    from kiln.errors import ConfigError
    from kiln.runtime.llm import LLM

    missing = tmp_path / "no-such-folder" / "steps.jsonl"
    with pytest.raises(ConfigError, match=r"runtime.step_log '.*no-such-folder/steps.jsonl' cannot be opened for "
                                          r"appending: No such file or directory"):
        LLM(batch_engine, step_log=str(missing))
    with pytest.raises(ValueError, match=r"step_log must be a file path \(a string; empty: none\), got 3"):
        LLM(batch_engine, step_log=3)
