"""Per-request options (TensorRT-LLM's request set) against independent references: Hugging
Face transformers' generate() with its own logits processors, and its logits."""
import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime.sampling import SamplingParams

PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 380, 45]


@pytest.fixture(scope="module")
def hf(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_engines, llm_for):
    return llm_for(tiny_engines("llama"))


def hf_generate(hf, n, **options):
    options.setdefault("eos_token_id", None)
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0, **options)
    return out[0, len(PROMPT):].tolist()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(llm, hf, penalty):
    want = hf_generate(hf, 24, repetition_penalty=penalty)
    assert want != hf_generate(hf, 24)  # the option matters for this prompt
    assert llm.generate(PROMPT, max_tokens=24, ignore_eos=True, repetition_penalty=penalty).token_ids == want


def test_bad_words_match_transformers(llm, hf):
    plain = hf_generate(hf, 16)
    bad = [[plain[0]], [plain[3], plain[4]]]  # a single token and a two-token sequence
    want = hf_generate(hf, 16, bad_words_ids=bad)
    got = llm.generate(PROMPT, max_tokens=16, ignore_eos=True, bad_words=tuple(map(tuple, bad))).token_ids
    assert got == want
    assert got[0] != plain[0]


def test_min_tokens_matches_transformers(llm, hf):
    plain = hf_generate(hf, 16)
    end = plain[2]  # treat the third greedy token as the end id: without min_tokens, 2 tokens
    first = plain.index(end)
    assert llm.generate(PROMPT, max_tokens=16, end_id=end).token_ids == plain[:first]
    want = hf_generate(hf, 16, eos_token_id=end, min_new_tokens=6)
    if end in want:
        want = want[: want.index(end)]
    got = llm.generate(PROMPT, max_tokens=16, end_id=end, min_tokens=6)
    assert got.token_ids == want and len(got.token_ids) >= 6


def test_presence_and_frequency_penalties_match_a_reference_loop(llm, hf):
    presence, frequency = 0.8, 0.6
    ids = list(PROMPT)
    for _ in range(20):  # the OpenAI formula, over prompt and output (TensorRT-LLM counts both)
        logits = hf_logits(hf, ids)[-1]
        counts = torch.bincount(torch.tensor(ids), minlength=logits.shape[0]).float()
        logits = logits - presence * (counts > 0).float() - frequency * counts
        ids.append(int(logits.argmax()))
    got = llm.generate(PROMPT, max_tokens=20, ignore_eos=True, presence_penalty=presence,
                       frequency_penalty=frequency).token_ids
    assert got == ids[len(PROMPT):]
    assert got != llm.generate(PROMPT, max_tokens=20, ignore_eos=True).token_ids


def test_embedding_bias_is_added_to_the_logits(llm):
    vocab = llm.engine.spec.vocab_size
    bias = [0.0] * vocab
    bias[77] = 1000.0
    got = llm.generate(PROMPT, max_tokens=5, ignore_eos=True, embedding_bias=tuple(bias)).token_ids
    assert got == [77] * 5
    with pytest.raises(RequestError, match="embedding_bias has 3 values"):
        llm.generate(PROMPT, max_tokens=5, embedding_bias=(0.0, 1.0, 2.0))


def test_stop_words_end_the_output_and_are_kept(llm):
    plain = llm.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids
    word = tuple(plain[5:7])
    first = next(i for i in range(1, len(plain)) if tuple(plain[max(i - 1, 0): i + 1]) == word)
    got = llm.generate(PROMPT, max_tokens=24, ignore_eos=True, stop_words=((5, 3, 4), word))
    assert got.token_ids == plain[: first + 1]
    assert got.finish_reason == "stop"


def test_log_probs_and_logits_equal_the_full_pass(llm, hf):
    out = llm.generate(PROMPT, max_tokens=12, ignore_eos=True, return_log_probs=True,
                       return_context_logits=True, return_generation_logits=True)
    full = hf_logits(hf, PROMPT + out.token_ids)
    positions = range(len(PROMPT) - 1, len(PROMPT) - 1 + len(out.token_ids))
    want = [float(torch.log_softmax(full[p], -1)[t]) for p, t in zip(positions, out.token_ids)]
    assert out.log_probs == pytest.approx(want, abs=1e-4)
    assert out.cum_log_prob == pytest.approx(sum(want), abs=1e-3)
    assert out.context_logits.shape == (len(PROMPT), full.shape[-1])
    assert (out.context_logits - full[: len(PROMPT)]).abs().max() < 1e-4
    assert out.generation_logits.shape == (len(out.token_ids), full.shape[-1])
    assert (out.generation_logits - full[list(positions)]).abs().max() < 1e-4


def test_sampled_log_probs_are_of_the_tempered_distribution(llm, hf):
    out = llm.generate(PROMPT, max_tokens=6, ignore_eos=True, temperature=0.7, seed=3, return_log_probs=True)
    full = hf_logits(hf, PROMPT + out.token_ids)
    want = [float(torch.log_softmax(full[len(PROMPT) - 1 + i] / 0.7, -1)[t]) for i, t in enumerate(out.token_ids)]
    assert out.log_probs == pytest.approx(want, abs=1e-4)


def test_context_logits_with_chunked_prefill_and_a_cached_prefix(batch_engine, llm_for, hf):
    """A prompt longer than max_num_tokens (256) is computed over two steps, and the same prefix
    is already cached: context logits must still cover every prompt position."""
    llm = llm_for(batch_engine, enable_prefix_reuse=True)
    long_prompt = (PROMPT * 20)[:250]
    llm.generate(long_prompt[:-1], max_tokens=1)  # leaves the prefix's blocks in the cache
    # with a request of 200 tokens beside it, the 250 tokens need two steps of 256
    busy = llm.stream([4] * 200, max_tokens=3)
    out = llm.generate(long_prompt, max_tokens=2, return_context_logits=True)
    list(busy)
    want = hf_logits(hf, long_prompt)
    assert out.context_logits.shape == want.shape
    assert (out.context_logits - want).abs().max() < 1e-4


def test_stream_chunks_carry_their_tokens_log_probs(llm):
    chunks = list(llm.stream(PROMPT, max_tokens=10, ignore_eos=True, return_log_probs=True))
    assert all(len(c.log_probs) == len(c.token_ids) for c in chunks)
    whole = llm.generate(PROMPT, max_tokens=10, ignore_eos=True, return_log_probs=True)
    assert [p for c in chunks for p in c.log_probs] == pytest.approx(whole.log_probs, abs=1e-5)


def test_invalid_options_are_refused(llm):
    with pytest.raises(RequestError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(RequestError, match="min_tokens must be >= 0"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(RequestError, match="stop_words token ids"):
        llm.generate(PROMPT, max_tokens=4, stop_words=((10**6,),))
