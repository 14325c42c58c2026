"""Incremental detokenization for streams: text deltas that never split a UTF-8 character.

Each delta is decode(prefix + new) minus decode(prefix), where prefix is a few tokens before
the new ones, so tokenizers that drop a leading space at the start of a decode (SentencePiece)
still give the right spacing. A delta whose decoding ends in U+FFFD (an incomplete byte
sequence) is held back until the next token completes it.

The Triton engine model needs only where such chunks end (postprocessing decodes the text), so
where the tokenizer says which bytes each token stands for (byte-level BPE, SentencePiece with
byte fallback: TokenBytes), the chunks are cut by looking at those bytes and no text is made."""
from __future__ import annotations

import codecs
import json

from tokenizers import Tokenizer

CONTEXT_TOKENS = 5


def decode_delta(tokenizer: Tokenizer, prefix: list[int], new: list[int]) -> str:
    """The text `new` adds after `prefix` (the stateless form, used by postprocessing)."""
    prefix_text = tokenizer.decode(prefix, skip_special_tokens=True)
    full_text = tokenizer.decode(prefix + new, skip_special_tokens=True)
    return full_text[len(prefix_text) :]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """The UTF-8 bytes each token id decodes to (special tokens: none, as decoding skips them),
    for the decoders whose mapping is fixed: byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen) and
    SentencePiece-style ("▁" for a space, <0xNN> byte tokens). `of` returns None for others."""

    def __init__(self, table: list[bytes]):
        self.table = table

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "TokenBytes | None":
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        if kinds == {"ByteLevel"}:
            alphabet = _byte_level_alphabet()

            def to_bytes(piece: str) -> bytes | None:
                if any(c not in alphabet for c in piece):
                    return None
                return bytes(alphabet[c] for c in piece)
        elif "ByteFallback" in kinds and kinds <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
            def to_bytes(piece: str) -> bytes | None:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode("utf-8")
        else:
            return None
        added = tokenizer.get_added_tokens_decoder()
        table = []
        for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            if token_id in added:
                table.append(b"" if added[token_id].special else added[token_id].content.encode("utf-8"))
                continue
            piece = tokenizer.id_to_token(token_id)
            raw = None if piece is None else to_bytes(piece)
            if raw is None:
                return None  # a token this mapping does not explain: decode instead
            table.append(raw)
        return cls(table)

    def bytes_of(self, token_ids: list[int]) -> bytes:
        return b"".join(self.table[t] if 0 <= t < len(self.table) else b"" for t in token_ids)


class IncrementalDetokenizer:
    """token_bytes given: `add` finds the chunks' ends from the tokens' bytes and returns no
    text (None in its place)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], token_bytes: TokenBytes | None = None):
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)  # ids before this are already in emitted text
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)
        if token_bytes is not None:  # a UTF-8 decoder's state over the bytes so far
            self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self.utf8.decode(token_bytes.bytes_of(self.ids[self.prefix_offset:]))
            self.pending_bytes = 0  # bytes of the tokens not yet emitted

    def add(self, token_ids: list[int], final: bool = False) -> tuple[list[int], list[int], str | None] | None:
        """Add tokens; return (prefix_ids, chunk_ids, text) when text can be emitted, else None.

        chunk_ids are all tokens not yet emitted (held-back ones included); with final=True
        whatever is pending is emitted even if it ends in an incomplete character."""
        self.ids.extend(token_ids)
        prefix = self.ids[self.prefix_offset : self.read_offset]
        chunk = self.ids[self.read_offset :]
        if not chunk:
            return None
        if self.token_bytes is not None:
            text = None
            data = self.token_bytes.bytes_of(token_ids)
            self.utf8.decode(data)
            self.pending_bytes += len(data)
            # held back while they stand for nothing or end inside a character
            if not final and (not self.pending_bytes or self.utf8.getstate()[0]):
                return None
            self.pending_bytes = 0
        else:
            text = decode_delta(self.tokenizer, prefix, chunk)
            if not final and (not text or text.endswith("\ufffd")):
                return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return prefix, chunk, text
