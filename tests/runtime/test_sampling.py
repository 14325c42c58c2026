"""Sampling, stopping and request limits through the Python API."""
import pytest
import torch

from kiln.errors import RequestError
from kiln.runtime.sampling import Sampler, SamplingParams, greedy_tokens


@pytest.fixture(scope="module")
def llm(tiny_engines, llm_for):
    return llm_for(tiny_engines("llama"))


PROMPT = [1, 40, 41, 42, 43]


def test_seed_makes_sampling_repeatable(llm):
    a = llm.generate(PROMPT, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    b = llm.generate(PROMPT, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    c = llm.generate(PROMPT, max_tokens=24, temperature=1.0, seed=8, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, max_tokens=16, ignore_eos=True)
    assert llm.generate(PROMPT, max_tokens=16, temperature=1.5, top_k=1, seed=3, ignore_eos=True).token_ids == greedy.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torch_argmax_with_ties_and_nans(dtype):
    seed = 20261202
    generator = torch.Generator().manual_seed(seed)
    # few distinct values, so most rows hold ties for their maximum
    logits = torch.randint(-4, 4, (16, 49152), generator=generator).to(dtype)
    logits[3, 100] = logits[5, 7] = logits[5, 90] = float("nan")  # a NaN wins; the first of two
    logits[6] = float("-inf")
    logits[7, 11] = float("inf")
    assert greedy_tokens(logits) == torch.argmax(logits, dim=-1).tolist(), f"seed {seed}"
    assert greedy_tokens(logits[5]) == 7 and greedy_tokens(logits[6]) == 0
    assert greedy_tokens(logits[:, ::2]) == torch.argmax(logits[:, ::2], dim=-1).tolist()  # a strided view


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    for seed in range(30):
        assert Sampler(SamplingParams(temperature=2.0, top_k=2, seed=seed))(logits) in (0, 1)
        # p(0) ~ 0.67, p(1) ~ 0.24: top_p 0.8 keeps exactly the first two
        assert Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=seed))(logits) in (0, 1)
    draws = {Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(200)}
    assert {0, 1, 2} <= draws


def test_stops_at_end_id(llm):
    greedy = llm.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    out = llm.generate(PROMPT, max_tokens=8, end_id=greedy[3])
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[: greedy.index(greedy[3])]


def test_max_tokens(llm):
    out = llm.generate(PROMPT, max_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stream_text_equals_generate(llm):
    chunks = list(llm.stream(PROMPT, max_tokens=20, ignore_eos=True))
    out = llm.generate(PROMPT, max_tokens=20, ignore_eos=True)
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], {}, "empty"),
        ([1] * 300, {}, "300 tokens, over this engine's max_input_len 256"),
        ([1] * 200, {"max_tokens": 400}, "over this engine's max_seq_len 512"),
        ([1, 99999], {}, "outside the vocabulary"),
        ([1], {"max_tokens": 0}, "max_tokens must be >= 1"),
        ([1], {"top_p": 0.0}, "top_p must be in"),
        ([1], {"temperature": -1.0}, "temperature must be >= 0"),
    ],
)
def test_bad_requests_are_refused(llm, prompt, params, message):
    with pytest.raises(RequestError, match=message):
        llm.generate(prompt, **params)
    assert llm.generate(PROMPT, max_tokens=2).token_ids  # still serving
