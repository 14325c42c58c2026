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


def byte_fallback_tokenizer():
    """A SentencePiece-style BPE ("▁" for spaces, <0xNN> tokens for bytes it lacks), as Llama 2
    and Mistral ship, trained on a little text so most non-ASCII characters fall back to bytes."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tokenizer.train_from_iterator(["Hello, world! hello there, the unicode text is here"] * 20, trainer)
    return tokenizer


@pytest.mark.parametrize("which", ["byte-level", "byte-fallback"])
@pytest.mark.parametrize("text", TEXTS)
def test_chunks_cut_by_token_bytes_are_the_decoded_ones(tokenizer, which, text):
    """The engine model's text-free chunking (TokenBytes) ends chunks exactly where the decoding
    detokenizer does, token by token, so postprocessing's deltas are the same."""
    from kiln.runtime.detokenizer import TokenBytes

    tok = tokenizer if which == "byte-level" else byte_fallback_tokenizer()
    table = TokenBytes.of(tok)
    assert table is not None
    prompt, rest = tok.encode("Say:").ids, tok.encode(text).ids
    assert which == "byte-level" or any(tok.id_to_token(t).startswith("<0x") for t in rest)  # bytes do occur
    plain, by_bytes = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt, table)
    for i, token in enumerate(rest):
        final = i == len(rest) - 1
        want, got = plain.add([token], final), by_bytes.add([token], final)
        assert (want is None) == (got is None), (i, token, want)
        if want is not None:
            assert want[:2] == got[:2] and got[2] is None
