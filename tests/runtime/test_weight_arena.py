"""The weight arena (runtime/weight_arena.py): every streamed weight in one allocation, end to end
in the order a decode step reads them, and the same numbers as weights left where loading put them."""
import pytest
import torch

from kiln.runtime.engine import Engine
from kiln.runtime.weight_arena import ALIGN, streamed
from tests.helpers import build_engine, forward_logits
from tests.runtime.test_decode_layers import SMALL, decode

PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 8]


@pytest.mark.parametrize("arch, dtype, quantization", [
    ("qwen2", "bfloat16", {"algo": "none"}),  # tied embeddings: the output projection is the table
    ("llama", "float32", {"algo": "none"}),
    ("llama", "bfloat16", {"algo": "int4_awq", "group_size": 32, "lm_head": "int4"}),
    ("llama", "bfloat16", {"algo": "int8_sq", "kv_cache": "int8"}),
    ("qwen3", "bfloat16", {"algo": "fp8"}),
    ("mixtral", "bfloat16", {"algo": "int8_wo"}),
])
def test_the_arena_holds_the_weights_in_step_order_and_changes_no_number(arch, dtype, quantization, tiny_models,
                                                                         tmp_path):
    engine_dir = build_engine(tmp_path / "e", tiny_models[arch], dtype, quantization={**quantization, **SMALL})
    arena, apart = Engine(engine_dir), Engine(engine_dir, weight_arena=False)
    places = streamed(arena.model)
    tensors = [getattr(owner, attr) for owner, attr in places]
    storage = tensors[0].untyped_storage()
    # one allocation, each tensor starting where the one before it ends (rounded up to ALIGN);
    # a tensor two owners share (tied embeddings) placed once
    expected, seen = storage.data_ptr(), {}
    for (owner, attr), t in zip(places, tensors):
        assert t.untyped_storage().data_ptr() == storage.data_ptr(), f"{type(owner).__name__}.{attr}"
        assert t.is_contiguous()
        if t.data_ptr() in seen:
            assert seen[t.data_ptr()] == t.nbytes
            continue
        assert t.data_ptr() == expected, f"{type(owner).__name__}.{attr} is not where the previous weight ends"
        seen[t.data_ptr()] = t.nbytes
        expected += -(-t.nbytes // ALIGN) * ALIGN
    assert expected - storage.data_ptr() == storage.nbytes()
    # (a tiled bf16 output projection is a copy of the table, in the tiled bf16 layout)
    tied = arena.spec.tie_embeddings and not quantization.get("lm_head") and not arena.model.lm_head.tiled
    lm_head = arena.model.lm_head
    assert (arena.model.embed.data_ptr() == getattr(lm_head, lm_head.streamed_attr).data_ptr()) == tied
    assert len(seen) == len(places) - tied
    # the same tensors by value as the engine loaded without the arena
    for (owner, attr), (other, other_attr) in zip(places, streamed(apart.model)):
        assert torch.equal(getattr(owner, attr).view(torch.uint8), getattr(other, other_attr).view(torch.uint8))
    # and the same logits: a prompt in two chunks, then fused decode steps of 1 and 3 rows. Bit for
    # bit where kiln's kernels compute (bf16); float32 steps run PyTorch's GEMM, whose sums depend
    # on the weights' alignment, and loaded apart the small ones stay at the file's 8-byte offsets
    # (with the linear weights copied to 64-byte-aligned memory, the two agree bit for bit)
    def same(got, want):
        if dtype == "bfloat16":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    same(forward_logits(arena, PROMPT, [5, 7]), forward_logits(apart, PROMPT, [5, 7]))
    for rows in (1, 3):
        got_logits, got_pool = decode(arena.model, arena.spec, True, 3, rows)
        want_logits, want_pool = decode(apart.model, apart.spec, True, 3, rows)
        same(got_logits, want_logits)
        same(got_pool, want_pool)
