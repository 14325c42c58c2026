"""kiln::paged_attention against the PyTorch reference on random batches."""
import random

import pytest
import torch

from kiln.plugins import ops, reference
from kiln.plugins.formats import hadamard_block, hadamard_matrix, hadamard_transform


def random_batch(rng: random.Random, dtype, heads, kv_heads, head_dim, block_size, seqs, max_new, max_context):
    """A packed batch: per sequence a random cached context and a random number of new tokens,
    blocks scattered over the pool in random order."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    contexts = [rng.randrange(0, max_context + 1) for _ in range(seqs)]
    news = [rng.randrange(1, max_new + 1) for _ in range(seqs)]
    needs = [-(-(c + n) // block_size) for c, n in zip(contexts, news)]
    max_blocks = max(needs)
    num_blocks = sum(needs) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(seqs, max_blocks, dtype=torch.int32)
    for s, need in enumerate(needs):
        tables[s, :need] = torch.tensor([ids.pop() for _ in range(need)], dtype=torch.int32)
    tokens = sum(news)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    angles = torch.rand(max_context + max_new + 1, head_dim, generator=g) * 6.3
    return dict(
        qkv=rnd(tokens, (heads + 2 * kv_heads) * head_dim),
        k_pool=rnd(num_blocks, kv_heads, block_size, head_dim), v_pool=rnd(num_blocks, kv_heads, block_size, head_dim),
        block_tables=tables,
        query_start=torch.tensor([0] + list(torch.tensor(news).cumsum(0)), dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), heads=heads,
    )


SHAPES = [
    # heads, kv_heads, head_dim, block_size, seqs, max_new, max_context
    (4, 4, 64, 32, 1, 1, 0),      # the very first token, MHA
    (9, 3, 64, 32, 5, 40, 100),   # SmolLM2's GQA 3, prefill chunks over cached context
    (8, 1, 32, 16, 7, 1, 300),    # GQA 8, decode only, many blocks
    (6, 2, 48, 7, 4, 19, 33),     # odd block size and head_dim, lengths off the block grid
    (2, 2, 6, 5, 3, 9, 12),       # tiny head_dim (the scalar tail only)
    (4, 2, 128, 16, 2, 6, 40),    # head_dim 128 (Llama 7B's; the rotation's largest in-register block)
    (12, 2, 64, 32, 2, 3, 2200),  # GQA 6 (heads in groups of 4 and 2), contexts of up to 16 chunks
]


@pytest.mark.parametrize("rotate", [False, True], ids=["keys", "rotated-keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention_matches_reference(isa, dtype, shape, rotate):
    rng = random.Random(f"{isa}{dtype}{shape}{rotate}")
    key_hadamard = hadamard_block(shape[2]) if rotate else 0
    for _ in range(3):
        batch = random_batch(rng, dtype, *shape)
        ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        scale = shape[2] ** -0.5
        got = ops.paged_attention(**batch, scale=scale, key_hadamard=key_hadamard)
        want = reference.paged_attention(**ref, scale=scale, key_hadamard=key_hadamard)
        assert torch.equal(batch["k_pool"], ref["k_pool"]) and torch.equal(batch["v_pool"], ref["v_pool"])
        # bf16: the kernel rounds as the reference does, but accumulates in another order
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


WINDOWED = [  # (shape, window): windows within a block, across blocks, of whole blocks, past every context
    ((9, 3, 64, 32, 5, 40, 100), 1), ((9, 3, 64, 32, 5, 40, 100), 37), ((6, 2, 48, 7, 4, 19, 33), 7),
    ((8, 1, 32, 16, 7, 1, 300), 64), ((12, 2, 64, 32, 2, 3, 2200), 1000), ((2, 2, 6, 5, 3, 9, 12), 500),
]


@pytest.mark.parametrize("pool_dtype", [None, torch.int8], ids=["model-dtype-pool", "int8-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, window", WINDOWED)
def test_sliding_window_attention_matches_reference(isa, dtype, pool_dtype, shape, window):
    """With a sliding window W each token attends to its last W positions only (prefill chunks
    and decode tokens, windows inside one block, across blocks and past the context)."""
    rng = random.Random(f"{isa}{dtype}{pool_dtype}{shape}{window}")
    for _ in range(2):
        batch = random_batch(rng, dtype, *shape)
        if pool_dtype is not None:
            batch = quantized_pools(batch, pool_dtype, torch.Generator().manual_seed(rng.randrange(2**31)))
        ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        scale = shape[2] ** -0.5
        got = ops.paged_attention(**batch, scale=scale, window=window)
        want = reference.paged_attention(**ref, scale=scale, window=window)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        ends = batch["context_lens"] + batch["query_start"].diff()  # each sequence's positions + 1
        if int(ends.max()) > window:  # the window hides something: attending to everything differs
            plain = reference.paged_attention(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                                 for k, v in batch.items()}, scale=scale)
            assert not torch.allclose(plain.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary", [(64, 48), (96, 72), (48, 32), (16, 2)])
def test_partial_rotary_matches_reference(isa, dtype, head_dim, rotary):
    """Rotary tables narrower than the head (Phi-4-mini's partial_rotary_factor): the first `rotary`
    values of each query and key rotate (in vector lanes where half of it fills them), the rest
    pass unchanged."""
    rng = random.Random(f"{isa}{dtype}{head_dim}{rotary}")
    for _ in range(2):
        batch = random_batch(rng, dtype, 6, 2, head_dim, 16, 3, 9, 40)
        batch["cos"], batch["sin"] = batch["cos"][:, :rotary].contiguous(), batch["sin"][:, :rotary].contiguous()
        ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        got = ops.paged_attention(**batch, scale=head_dim**-0.5)
        want = reference.paged_attention(**ref, scale=head_dim**-0.5)
        assert torch.equal(batch["k_pool"], ref["k_pool"])  # the stored keys: rotated part and passed part
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("width", [0, 7, 34])
def test_rotary_tables_of_a_bad_width_are_refused(plugin_isas, width):
    batch = random_batch(random.Random(5), torch.float32, 2, 1, 32, 4, 1, 2, 3)
    batch["cos"] = batch["sin"] = torch.ones(batch["cos"].shape[0], width)
    with pytest.raises(RuntimeError, match="an even number of rotary dims up to head_dim 32"):
        ops.paged_attention(**batch, scale=1.0)


def test_negative_window_is_refused(plugin_isas):
    batch = random_batch(random.Random(3), torch.float32, 2, 1, 16, 4, 1, 2, 3)
    with pytest.raises(RuntimeError, match="window must be 0"):
        ops.paged_attention(**batch, scale=1.0, window=-1)


def quantized_pools(batch, pool_dtype, g):
    """The batch with int8 / fp8 pools (earlier contexts: random stored values) and random
    per-channel scales, some small enough to saturate."""
    shape = batch["k_pool"].shape
    kv_size = shape[1] * shape[3]
    if pool_dtype == torch.int8:
        pools = [torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2)]
    else:
        pools = [(torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(2)]
    scales = torch.rand(2, kv_size, generator=g) * 0.05 + (0.002 if pool_dtype == torch.int8 else 0.0005)
    return {**batch, "k_pool": pools[0], "v_pool": pools[1], "kv_scales": scales}


@pytest.mark.parametrize("rotate", [False, True], ids=["keys", "rotated-keys"])
@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_kv_cache_matches_reference(isa, dtype, pool_dtype, shape, rotate):
    """int8 / FP8 pools: the stored bytes equal the reference's quantization exactly (keys
    rotated by the Hadamard transform or not), and the attention over them (scales folded into
    the query and the output) matches."""
    rng = random.Random(f"{isa}{dtype}{pool_dtype}{shape}{rotate}")
    key_hadamard = hadamard_block(shape[2]) if rotate else 0
    for _ in range(2):
        batch = quantized_pools(random_batch(rng, dtype, *shape), pool_dtype,
                                torch.Generator().manual_seed(rng.randrange(2**31)))
        ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        scale = shape[2] ** -0.5
        got = ops.paged_attention(**batch, scale=scale, key_hadamard=key_hadamard)
        want = reference.paged_attention(**ref, scale=scale, key_hadamard=key_hadamard)
        for name in ("k_pool", "v_pool"):
            assert torch.equal(batch[name].view(torch.uint8), ref[name].view(torch.uint8)), name
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim, block", [(64, 64), (48, 16), (6, 2), (128, 32)])
def test_hadamard_transform_is_the_orthonormal_matrix(head_dim, block):
    """The reference's butterflies (the kernel's arithmetic) against the dense matrix, which is
    symmetric and its own inverse; attention scores are unchanged by it."""
    g = torch.Generator().manual_seed(head_dim * block)
    h = hadamard_matrix(head_dim, block)
    torch.testing.assert_close(h @ h, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(h, h.T)
    assert set(h.abs().unique().tolist()) <= {0.0, torch.tensor(block**-0.5, dtype=torch.float32).item()}
    q, k = torch.randn(7, head_dim, generator=g), torch.randn(5, head_dim, generator=g)
    torch.testing.assert_close(hadamard_transform(q, block), q @ h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hadamard_transform(q, block) @ hadamard_transform(k, block).T, q @ k.T,
                               atol=1e-4, rtol=1e-5)


def test_key_hadamard_must_be_a_power_of_two_dividing_head_dim(plugin_isas):
    batch = random_batch(random.Random(6), torch.float32, 2, 2, 24, 4, 1, 3, 5)
    for bad in (3, 16, 32, -8, 1):
        with pytest.raises(RuntimeError, match="key_hadamard must be 0 or a power of two dividing head_dim 24"):
            ops.paged_attention(**batch, scale=1.0, key_hadamard=bad)
    ops.paged_attention(**batch, scale=1.0, key_hadamard=8)


EDGES = {  # values the KV write must round exactly as torch does (ties, subnormals, saturation)
    torch.float8_e4m3fn: [0.0, -0.0, 2**-10, 1.5 * 2**-9, 2.5 * 2**-9, 2**-6 - 2**-11, 2**-6, 1e-30, -1e-30,
                          1.0625, 1.1875, -1.0625, 3.0, 447.0, 448.0, 449.0, 464.0, 1000.0, -1000.0, 0.1, -300.0],
    torch.int8: [0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.4, 200.0, -200.0, -126.5, 1e-30, 3.7, -3.7],
}


@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kv_write_rounds_edge_values_as_torch(isa, pool_dtype):
    """The KV write's vector rounding (16 at a time, then a scalar tail: head_dim 40) against
    torch's conversion, on ties, subnormals and values beyond the format's range."""
    g = torch.Generator().manual_seed(7)
    edges = torch.tensor(EDGES[pool_dtype])
    tokens, head_dim = 6, 40
    qkv = edges[torch.randint(len(edges), (tokens, 3 * head_dim), generator=g)]
    qkv *= torch.where(torch.rand(tokens, 3 * head_dim, generator=g) < 0.5, -1.0, 1.0)
    batch = dict(qkv=qkv, block_tables=torch.tensor([[0]], dtype=torch.int32),
                 query_start=torch.tensor([0, tokens], dtype=torch.int32),
                 context_lens=torch.tensor([0], dtype=torch.int32),
                 cos=torch.ones(tokens, head_dim), sin=torch.zeros(tokens, head_dim), heads=1, scale=0.1,
                 kv_scales=torch.ones(2, head_dim))  # rotary embedding and scales leave the values as they are
    got = [torch.zeros(1, 1, 8, head_dim).to(pool_dtype) for _ in range(2)]
    want = [p.clone() for p in got]
    ops.paged_attention(k_pool=got[0], v_pool=got[1], **batch)
    reference.paged_attention(k_pool=want[0], v_pool=want[1], **batch)
    for g_pool, w_pool in zip(got, want):
        assert torch.equal(g_pool.view(torch.uint8), w_pool.view(torch.uint8))


def test_quantized_pools_need_their_scales(plugin_isas):
    batch = random_batch(random.Random(5), torch.float32, 2, 2, 8, 4, 1, 3, 5)
    quantized = quantized_pools(batch, torch.int8, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="kv_scales go with"):
        ops.paged_attention(**{**quantized, "kv_scales": None}, scale=1.0)
    with pytest.raises(RuntimeError, match="kv_scales go with"):
        ops.paged_attention(**{**batch, "kv_scales": quantized["kv_scales"]}, scale=1.0)
    with pytest.raises(RuntimeError, match=r"kv_scales must be contiguous float32 \[2, 16\]"):
        ops.paged_attention(**{**quantized, "kv_scales": quantized["kv_scales"][:, :8].contiguous()}, scale=1.0)
    with pytest.raises(RuntimeError, match="pools must both be"):
        ops.paged_attention(**{**quantized, "v_pool": batch["v_pool"]}, scale=1.0)


def test_chunked_prefill_equals_one_pass(plugin_isas):
    """A prompt prefilled in chunks, then decoded, matches a single prefill pass."""
    torch.manual_seed(0)
    total, heads, kv_heads, dim, bs = 23, 6, 3, 32, 4
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(total, dim) * 6.3
    table = torch.tensor([[5, 2, 7, 0, 1, 3]], dtype=torch.int32)

    def run(a, b, k_pool, v_pool):
        qs = torch.tensor([0, b - a], dtype=torch.int32)
        return ops.paged_attention(qkv[a:b], k_pool, v_pool, table, qs, torch.tensor([a], dtype=torch.int32),
                                   angles.cos(), angles.sin(), heads, 0.2)

    pools = lambda: (torch.zeros(8, kv_heads, bs, dim), torch.zeros(8, kv_heads, bs, dim))  # noqa: E731
    whole = run(0, total, *pools())
    kp, vp = pools()
    parts = [run(a, b, kp, vp) for a, b in ((0, 9), (9, 10), (10, 22), (22, 23))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hadamard, bs", [(True, 8), (False, 16)], ids=["rotated-bs8", "bs16"])
@pytest.mark.parametrize("pool_dtype", [torch.int8, torch.float8_e4m3fn])
def test_prefill_over_a_quantized_pool_equals_one_token_at_a_time(isa, pool_dtype, hadamard, bs):
    """A prefill chunk reads its sequence's blocks widened once to bf16; one token at a time
    reads them from the pool (keys rotated in blocks of 8, or not in blocks of 16): the same
    bytes, the same bits out."""
    g = torch.Generator().manual_seed(3)
    total, heads, kv_heads, dim = 37, 6, 2, 64
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    angles = torch.rand(total, dim, generator=g) * 6.3
    table = torch.tensor([[3, 0, 5, 1, 2, 4]], dtype=torch.int32)
    scales = torch.rand(2, kv_heads * dim, generator=g) * 0.02 + 0.005

    def run(a, b, pools):
        qs = torch.tensor([0, b - a], dtype=torch.int32)
        return ops.paged_attention(qkv[a:b], *pools, table, qs, torch.tensor([a], dtype=torch.int32),
                                   angles.cos().bfloat16(), angles.sin().bfloat16(), heads, 0.125, scales,
                                   key_hadamard=dim if hadamard else 0)

    chunked = [torch.zeros(6, kv_heads, bs, dim).to(pool_dtype) for _ in range(2)]
    single = [p.clone() for p in chunked]
    got = torch.cat([run(a, b, chunked) for a, b in ((0, 20), (20, 21), (21, 37))])
    want = torch.cat([run(i, i + 1, single) for i in range(total)])
    assert torch.equal(got, want)
    for c, w in zip(chunked, single):
        assert torch.equal(c.view(torch.uint8), w.view(torch.uint8))


def test_bad_block_table_is_refused_before_writing(plugin_isas):
    batch = random_batch(random.Random(1), torch.float32, 2, 2, 8, 4, 2, 3, 5)
    batch["block_tables"][1, 0] = 10_000
    before = batch["k_pool"].clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_attention(**batch, scale=1.0)
    assert torch.equal(batch["k_pool"], before)


def test_positions_beyond_the_table_are_refused(plugin_isas):
    batch = random_batch(random.Random(2), torch.float32, 2, 2, 8, 4, 1, 3, 5)
    batch["context_lens"][0] = 100
    with pytest.raises(RuntimeError, match="beyond its block table"):
        ops.paged_attention(**batch, scale=1.0)


def test_rotary_tables_too_short_are_refused(plugin_isas):
    batch = random_batch(random.Random(4), torch.float32, 2, 2, 8, 4, 1, 3, 5)
    batch["cos"], batch["sin"] = batch["cos"][:0], batch["sin"][:0]
    with pytest.raises(RuntimeError, match="beyond the rotary tables"):
        ops.paged_attention(**batch, scale=1.0)


def decode_row(batch, t):
    """Token t of a packed batch (after the batch wrote its keys and values) as a one-token
    decode step over the same pool: its sequence's cached context is every earlier position."""
    starts = batch["query_start"].tolist()
    s = max(i for i in range(len(starts) - 1) if starts[i] <= t)
    position = int(batch["context_lens"][s]) + t - starts[s]
    return {**batch, "qkv": batch["qkv"][t:t + 1], "block_tables": batch["block_tables"][s:s + 1],
            "query_start": torch.tensor([0, 1], dtype=torch.int32),
            "context_lens": torch.tensor([position], dtype=torch.int32)}


INVARIANCE_CASES = [
    # pool dtype, (heads, kv_heads, head_dim, block_size, seqs, max_new, max_context)
    (None, (9, 3, 64, 32, 3, 12, 2000)),     # SmolLM2's GQA 3: five tokens a tile on AMX
    (torch.int8, (9, 3, 64, 32, 3, 12, 2000)),
    (None, (4, 4, 64, 16, 2, 20, 2100)),     # MHA (up to 16 tokens a tile), blocks of 16
    (None, (16, 2, 128, 48, 2, 9, 300)),     # GQA 8, head_dim 128, a block of 48 (keys in 32 + 16)
    (None, (12, 2, 96, 32, 2, 7, 400)),      # GQA 6, head_dim 96 (three steps of 32 dims)
    (torch.float8_e4m3fn, (4, 4, 64, 16, 2, 20, 700)),  # FP8, MHA: 16 tokens a tile
    (torch.int8, (16, 2, 128, 48, 2, 9, 300)),          # int8, GQA 8, head_dim 128
]


@pytest.mark.parametrize("pool_dtype,shape", INVARIANCE_CASES,
                         ids=["bf16-pool", "int8-pool", "mha-long", "gqa8-hd128", "gqa6-hd96", "fp8-mha",
                              "int8-gqa8-hd128"])
def test_attention_does_not_depend_on_the_batch_or_the_thread_count(isa, pool_dtype, shape):
    """A token's attention is the same bits in a prefill chunk of several sequences as in a decode
    step of its own, and on 1, 2 or 3 threads, over contexts long enough to be split into chunks
    that different threads run and that are merged afterwards (up to 16 at 2,000 positions)."""
    rng = random.Random(f"invariance{isa}{pool_dtype}{shape}")
    batch = random_batch(rng, torch.bfloat16, *shape)
    if pool_dtype is not None:
        batch = quantized_pools(batch, pool_dtype, torch.Generator().manual_seed(rng.randrange(2**31)))
    scale = shape[2] ** -0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = ops.paged_attention(**batch, scale=scale)  # writes the batch's keys and values
        tokens = list(range(batch["qkv"].shape[0]))
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(ops.paged_attention(**batch, scale=scale), whole), f"{threads} threads"
            for t in rng.sample(tokens, min(6, len(tokens))):
                alone = ops.paged_attention(**decode_row(batch, t), scale=scale)
                assert torch.equal(alone[0], whole[t]), f"token {t} alone on {threads} threads"
    finally:
        torch.set_num_threads(before)


CUTS_150 = (0, 1, 2, 9, 10, 47, 48, 49, 100, 101, 150)  # chunks of 1, 1, 7, 1, 37, 1, 1, 51, 1, 49 tokens
# chunks beside position 2,048, where a context's chunks grow from 128 positions to 144 (blocks of 16;
# 16 chunks at most): the chunk from 2,042 would put tokens from both sides of it in one tile
CUTS_2080 = (0, 2000, 2041, 2042, 2080)


@pytest.mark.parametrize("heads,kv_heads,dim,bs,cuts", [(9, 3, 64, 32, CUTS_150), (4, 4, 64, 16, CUTS_150),
                                                       (8, 1, 32, 48, CUTS_150), (4, 4, 64, 16, CUTS_2080)],
                         ids=["gqa3", "mha-bs16", "gqa8-bs48", "mha-past-2048"])
def test_a_prompt_in_chunks_of_any_size_is_the_same_bits_as_in_one(isa, heads, kv_heads, dim, bs, cuts):
    """A bf16 prompt prefilled in chunks of 1 to 2,000 tokens (the scheduler's token budget decides
    them) gives every token the same bits as one pass over the whole prompt: on AMX the chunks
    group different tokens into tiles, which must not change any token's result."""
    g = torch.Generator().manual_seed(11)
    total = cuts[-1]
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    angles = torch.rand(total, dim, generator=g) * 6.3
    blocks = -(-total // bs)
    table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32).reshape(1, blocks)

    def run(a, b, pools):
        qs = torch.tensor([0, b - a], dtype=torch.int32)
        return ops.paged_attention(qkv[a:b], *pools, table, qs, torch.tensor([a], dtype=torch.int32),
                                   angles.cos().bfloat16(), angles.sin().bfloat16(), heads, dim**-0.5)

    def pools():
        return [torch.zeros(blocks + 2, kv_heads, bs, dim, dtype=torch.bfloat16) for _ in range(2)]

    whole = run(0, total, pools())
    chunked = pools()
    parts = torch.cat([run(a, b, chunked) for a, b in zip(cuts, cuts[1:])])
    for t in range(total):
        assert torch.equal(parts[t], whole[t]), f"token {t}"
