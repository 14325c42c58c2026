"""Incremental detokenization never splits a UTF-8 character and equals a full decode."""
import pytest

from kiln.runtime.detokenizer import IncrementalDetokenizer, decode_delta
from tokenizers import Tokenizer

TEXTS = ["Hello, world! héllo ünïcode", "日本語のテキストと絵文字 🎉🚀 mixed with English", "👩‍👩‍👧 family, 🇫🇷 flag"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_engines):
    return Tokenizer.from_file(str(smollm2_engines("bfloat16") / "tokenizer" / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text(tokenizer, text):
    prompt = tokenizer.encode("Say:").ids
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for i, token in enumerate(ids):
        emitted = detok.add([token], final=i == len(ids) - 1)
        if emitted:
            prefix, chunk, delta = emitted
            assert "\ufffd" not in delta
            assert decode_delta(tokenizer, prefix, chunk) == delta  # what postprocessing computes
            pieces.append(delta)
    assert "".join(pieces) == tokenizer.decode(ids)
