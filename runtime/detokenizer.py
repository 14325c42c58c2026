"""Incremental detokenization for streams: text deltas that never split a UTF-8 character.

Each delta is decode(prefix + new) minus decode(prefix), where prefix is a few tokens before
the new ones, so tokenizers that drop a leading space at the start of a decode (SentencePiece)
still give the right spacing. A delta whose decoding ends in U+FFFD (an incomplete byte
sequence) is held back until the next token completes it."""
from __future__ import annotations

from tokenizers import Tokenizer

CONTEXT_TOKENS = 5


def decode_delta(tokenizer: Tokenizer, prefix: list[int], new: list[int]) -> str:
    """The text `new` adds after `prefix` (the stateless form, used by postprocessing)."""
    prefix_text = tokenizer.decode(prefix, skip_special_tokens=True)
    full_text = tokenizer.decode(prefix + new, skip_special_tokens=True)
    return full_text[len(prefix_text) :]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)  # ids before this are already in emitted text
        self.prefix_offset = max(self.read_offset - CONTEXT_TOKENS, 0)

    def add(self, token_ids: list[int], final: bool = False) -> tuple[list[int], list[int], str] | None:
        """Add tokens; return (prefix_ids, chunk_ids, text) when text can be emitted, else None.

        chunk_ids are all tokens not yet emitted (held-back ones included); with final=True
        whatever is pending is emitted even if it ends in an incomplete character."""
        self.ids.extend(token_ids)
        prefix = self.ids[self.prefix_offset : self.read_offset]
        chunk = self.ids[self.read_offset :]
        if not chunk:
            return None
        text = decode_delta(self.tokenizer, prefix, chunk)
        if not final and (not text or text.endswith("\ufffd")):
            return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return prefix, chunk, text
