"""The real SmolLM2-135M-Instruct GGUF: kiln's greedy tokens equal transformers' on the same file."""
import pytest
import torch

from tests.helpers import SMOLLM2_FILE, smollm2_dir

# no digits: transformers' tokenizer built from the GGUF does not split digits one by one as
# the model's own (and kiln's rebuilt) tokenizer does
PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "The best way to learn a new language is",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    # transformers computes GGUF weights in float32; the float32 engine is the like-for-like build
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def llm(smollm2_engines, llm_for):
    return llm_for(smollm2_engines("float32"))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_32_tokens_identical_to_transformers(prompt, hf, llm):
    tokenizer, model = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert llm.encode(prompt) == ids[0].tolist()
    want = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    out = llm.generate(prompt, max_tokens=32)
    got = out.token_ids + ([2] if out.finish_reason == "stop" else [])  # HF keeps the end id
    assert got == want
    assert out.text == tokenizer.decode(out.token_ids)


def test_smollm2_logits_match_transformers(hf, llm):
    tokenizer, model = hf
    ids = tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    with torch.no_grad():
        want = model(ids).logits[0]
    from tests.helpers import forward_logits

    got = forward_logits(llm.engine, ids[0].tolist())
    assert (got - want).abs().max().item() < 2e-4


def test_smollm2_tokenizer_splits_digits_like_the_model(llm):
    assert llm.tokenizer.encode("in 2024").tokens == ["in", "Ġ", "2", "0", "2", "4"]


def test_smollm2_bfloat16_engine_answers(smollm2_engines, llm_for):
    out = llm_for(smollm2_engines("bfloat16")).generate("The capital of France is", max_tokens=8)
    assert "Paris" in out.text


def test_a_request_past_request_timeout_ends_with_what_it_generated(smollm2_engines, llm_for, llm):
    """runtime.request_timeout ends a live request with finish reason 'timeout', its tokens so far
    (the same as an untimed run's first ones), and its KV blocks freed. 600 tokens take the float32
    engine many seconds; the timeout is 0.5 s."""
    prompt = "Write a very long story about a lighthouse keeper."
    timed = llm_for(smollm2_engines("float32"), request_timeout=0.5, kv_cache_memory="64MiB")
    out = timed.generate(prompt, max_tokens=600, ignore_eos=True)
    assert out.finish_reason == "timeout"
    assert len(out.token_ids) < 600
    assert out.token_ids == llm.generate(prompt, max_tokens=len(out.token_ids), ignore_eos=True).token_ids
    stats = timed.stats()
    assert (stats["running"], stats["queued"]) == (0, 0)
    assert stats["blocks_used"] == 0


def test_a_prompt_spread_by_prefill_per_decode_beside_streams_gets_its_lone_tokens(smollm2_engines, llm_for, llm):
    """runtime.prefill_per_decode = 1 beside 3 decoding streams (prefill_per_decode_from 1): the
    long prompt goes in chunks of 16 tokens (PREFILL_MIN_CHUNK), and its tokens are the ones it
    gets alone."""
    spread = llm_for(smollm2_engines("float32"), prefill_per_decode=1.0, prefill_max_wait=600.0,
                     prefill_per_decode_from=1, kv_cache_memory="64MiB")
    scheduler = spread.executor.scheduler
    assert (scheduler.prefill_per_decode, scheduler.prefill_max_wait,
            scheduler.prefill_per_decode_from) == (1.0, 600.0, 1)
    streams = [spread.stream(f"Count to ten in {language}:", max_tokens=40, ignore_eos=True)
               for language in ("French", "German", "Spanish")]
    for stream in streams:
        next(stream)  # each has its first token: all three decode from here
    long_prompt = " ".join(["The lighthouse keeper wrote in the log every night before the lamp was lit."] * 6)
    steps_before = spread.stats()["steps"]
    long_stream = spread.stream(long_prompt, max_tokens=8, ignore_eos=True)
    first = next(long_stream)
    steps_to_first = spread.stats()["steps"] - steps_before
    tokens = first.token_ids + [t for chunk in long_stream for t in chunk.token_ids]
    for stream in streams:
        list(stream)
    prompt_tokens = len(spread.encode(long_prompt))
    assert prompt_tokens >= 80
    assert steps_to_first >= prompt_tokens // 16, (steps_to_first, prompt_tokens)  # chunks of 16: not 1 step
    assert tokens == llm.generate(long_prompt, max_tokens=8, ignore_eos=True).token_ids


def test_request_timeout_must_be_finite_and_not_negative(smollm2_engines):
    from kiln.runtime.llm import LLM

    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="request_timeout"):
            LLM(smollm2_engines("float32"), request_timeout=bad)
