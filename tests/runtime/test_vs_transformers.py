"""kiln engines against Hugging Face transformers on tiny random Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 3 (a sliding-window layer of window 6 and a global one: every prompt here is longer) and the
Mixture-of-Experts Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE (2 of 4 / 6 / 4 / 4 experts a token;
OLMoE's q / k norms span every head; Qwen2-MoE adds a gated shared expert)."""
import pytest
import torch

from tests.helpers import build_engine, forward_logits

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe"]
PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 380, 45]


def hf_model(folder, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def engine_logits(llm, ids: list[int]) -> torch.Tensor:
    return forward_logits(llm.engine, ids)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_at_every_position(arch, tiny_models, tiny_engines, llm_for):
    llm = llm_for(tiny_engines(arch))
    with torch.no_grad():
        want = hf_model(tiny_models[arch], torch.float32)(torch.tensor([PROMPT])).logits[0]
    got = engine_logits(llm, PROMPT)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_across_decode_steps(arch, tiny_models, tiny_engines, llm_for):
    """Prefill then one token at a time through the cache: same logits as one HF pass."""
    llm = llm_for(tiny_engines(arch))
    with torch.no_grad():
        want = hf_model(tiny_models[arch], torch.float32)(torch.tensor([PROMPT])).logits[0]
    got = forward_logits(llm.engine, PROMPT, chunks=[5] + [1] * (len(PROMPT) - 5))
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_greedy_32_tokens_identical(arch, tiny_models, tiny_engines, llm_for):
    llm = llm_for(tiny_engines(arch))
    want = hf_greedy(hf_model(tiny_models[arch], torch.float32), PROMPT, 32)
    got = llm.generate(PROMPT, max_tokens=32, ignore_eos=True).token_ids
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_mixing_long_and_short_prompts_decodes_as_transformers(arch, tiny_models, tmp_path, llm_for):
    """Chunked prefill of a long prompt (max_num_tokens 64 < 104 tokens) in flight beside a short
    one: each gets the greedy tokens transformers gives it alone."""
    llm = llm_for(build_engine(tmp_path / arch, tiny_models[arch], max_num_tokens=64))
    model = hf_model(tiny_models[arch], torch.float32)
    prompts = [PROMPT * 8, PROMPT[:3]]
    outs = llm.generate(prompts, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]


BF16_LOGIT_BOUND = 0.1  # max |kiln - HF| of bfloat16 logits; HF's own eager vs sdpa differ by ~0.03


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_logit_bound_and_greedy_tokens(arch, tiny_models, tiny_engines, llm_for):
    """bf16 rounding makes greedy decoding path-dependent (HF's own cached decode differs from
    its full pass), so: logits within the bound at every position, and greedy tokens identical
    up to the first step where HF's top-2 margin is within twice the bound (a near tie)."""
    llm = llm_for(tiny_engines(arch, "bfloat16"))
    model = hf_model(tiny_models[arch], torch.bfloat16)
    want = hf_greedy(model, PROMPT, 32)
    got = llm.generate(PROMPT, max_tokens=32, ignore_eos=True).token_ids
    sequence = PROMPT + want
    with torch.no_grad():
        want_logits = model(torch.tensor([sequence])).logits[0].float()
    got_logits = engine_logits(llm, sequence)
    assert (got_logits - want_logits).abs().max().item() < BF16_LOGIT_BOUND
    if got != want:
        step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = want_logits[len(PROMPT) - 1 + step].topk(2).values
        margin = (top2[0] - top2[1]).item()
        assert margin < 2 * BF16_LOGIT_BOUND, f"diverged at step {step} with margin {margin}"


def test_mistral_sliding_window_beyond_max_seq_len_matches_transformers(tmp_path, llm_for):
    """A Mistral whose sliding window (5) is shorter than its prompts: logits at every position,
    through the cache one token at a time, and greedy tokens as transformers' windowed mask gives."""
    from tests.helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "mistral-window", "mistral", seed=5, sliding_window=5)
    llm = llm_for(build_engine(tmp_path / "engine", folder))
    assert llm.engine.spec.sliding_window == 5
    model = hf_model(folder, torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    assert (engine_logits(llm, PROMPT) - want).abs().max().item() < 1e-4
    got = forward_logits(llm.engine, PROMPT, chunks=[4, 3] + [1] * (len(PROMPT) - 7))
    assert (got - want).abs().max().item() < 1e-4
    assert llm.generate(PROMPT, max_tokens=24, ignore_eos=True).token_ids == hf_greedy(model, PROMPT, 24)


def test_gemma3_multimodal_checkpoint_builds_its_language_model(tmp_path, llm_for):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text config nested, the language
    model's tensors under a prefix beside a vision tower. kiln builds the language model (the vision
    tower is not part of a text engine): transformers' logits for text input at every position,
    and its greedy tokens."""
    from tests.helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "gemma3-mm", "gemma3-multimodal", seed=3)
    llm = llm_for(build_engine(tmp_path / "engine", folder))
    assert llm.engine.spec.architecture == "gemma3" and llm.engine.spec.full_attention_layers == (1,)
    model = hf_model(folder, torch.float32)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    assert (engine_logits(llm, PROMPT) - want).abs().max().item() < 1e-4
    assert llm.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids == hf_greedy(model, PROMPT, 16)


LONG_PROMPT = (PROMPT * 4)[:44]  # longer than the Phi-3 below's original context of 32


@pytest.mark.parametrize("max_seq_len, prompt", [(32, PROMPT), (512, LONG_PROMPT)], ids=["short", "long"])
def test_phi3_longrope_and_partial_rotary_match_transformers(max_seq_len, prompt, tmp_path, llm_for):
    """Phi-3.5 / Phi-4-mini style: LongRoPE (short and long divisors, original context 32, its
    factor on cos and sin) and rotary embedding on 3/4 of each head. An engine within the original
    context uses the short divisors, one beyond it the long, as transformers does for a sequence
    of that length: logits at every position and greedy tokens."""
    from tests.helpers import make_tiny_model

    half = 16 * 3 // 4 // 2  # head_dim 16 (hidden 64, 4 heads) x 0.75 rotary dims, in pairs
    g = torch.Generator().manual_seed(11)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist()}
    folder = make_tiny_model(tmp_path / "phi3", "phi3", seed=7, rope_parameters=rope,
                             original_max_position_embeddings=32)
    llm = llm_for(build_engine(tmp_path / "engine", folder, max_input_len=max_seq_len // 2, max_seq_len=max_seq_len))
    spec = llm.engine.spec
    assert spec.rotary_dim == 12 and spec.rope_longrope.attention_factor > 1
    model = hf_model(folder, torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    assert (engine_logits(llm, prompt) - want).abs().max().item() < 1e-4
    n = min(12, max_seq_len - len(prompt))
    assert llm.generate(prompt, max_tokens=n, ignore_eos=True).token_ids == hf_greedy(model, prompt, n)


def test_blocks_behind_the_window_are_released_and_reused(tmp_path, llm_for):
    """A Mistral whose every layer attends within a window of 5, blocks of 4 tokens, a pool of 20
    blocks: four sequences of 37 tokens (10 blocks each without release) decode at once. Each
    holds only the blocks its window still reaches, the released ones serve the others, and every
    sequence gets the greedy tokens transformers gives it alone."""
    from tests.helpers import make_tiny_model

    folder = make_tiny_model(tmp_path / "mistral-window", "mistral", seed=5, sliding_window=5)
    engine = build_engine(tmp_path / "engine", folder, max_input_len=32, max_seq_len=64, kv_block_size=4)
    llm = llm_for(engine, kv_cache_memory="20KiB", enable_prefix_reuse=False)  # 1 KiB a block here
    assert llm.executor.kv.num_blocks == 20 and llm.executor.kv.windows == (5,)
    model = hf_model(folder, torch.float32)
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:3], PROMPT[::-1], PROMPT[5:] + PROMPT[:5]]
    llm.executor.kv.reset_peak()
    outs = llm.generate(prompts, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 24) for p in prompts]
    # each sequence holds at most the blocks of its window and of one step's tokens, not its 10
    assert llm.executor.kv.stats()["blocks_used_peak"] <= 4 * 4
    assert llm.executor.scheduler.num_preemptions == 0
    assert llm.executor.kv.stats()["blocks_used"] == 0  # and all of them come back


def test_gemma3_local_layers_release_the_blocks_behind_their_window(tmp_path, tiny_models, llm_for):
    """Gemma 3's sliding-window layer (window 6) and its global layer keep their keys in block
    tables of their own (blocks of 4 tokens, a pool of 56): four sequences of 37 tokens decode at
    once. Each holds its 10 blocks for the global layer and at most 3 for the local one, not 10
    (20 each, 80 in all, without the second table: the pool would preempt), and every sequence gets
    the greedy tokens transformers gives it alone."""
    from kiln.runtime.engine import Engine
    from kiln.runtime.model import KVPool

    engine = build_engine(tmp_path / "engine", tiny_models["gemma3"], max_input_len=32, max_seq_len=64,
                          kv_block_size=4)
    loaded = Engine(engine)  # (the spec and KV dtype the engine holds)
    per_block = KVPool.bytes_per_block(loaded.spec, 4, loaded.model.kv_dtype, grouped=True)
    llm = llm_for(engine, kv_cache_memory=f"{56 * per_block}B", enable_prefix_reuse=False)
    executor = llm.executor
    assert executor.kv.num_blocks == 56 and executor.kv.windows == (6, 0)
    model = hf_model(tiny_models["gemma3"], torch.float32)
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:3], PROMPT[::-1], PROMPT[5:] + PROMPT[:5]]
    executor.kv.reset_peak()
    outs = llm.generate(prompts, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 24) for p in prompts]
    assert executor.scheduler.num_preemptions == 0
    assert executor.kv.stats()["blocks_used_peak"] <= 4 * (10 + 3)
    assert executor.kv.stats()["blocks_used"] == 0
