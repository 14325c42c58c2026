"""The Python API: `LLM(engine_dir).generate(...)` and streaming with `LLM.stream(...)`.

Requests run one at a time in this version (a lock serializes them)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kiln.errors import RequestError
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.engine import Engine
from kiln.runtime.model import KVCache
from kiln.runtime.sampling import Sampler, SamplingParams

FINISH_STOP = "stop"  # an end id was sampled
FINISH_LENGTH = "length"  # max_tokens reached


@dataclass
class StreamChunk:
    """New tokens and the text they add; `prefix_ids` are the tokens decoding needs before
    them (see detokenizer). The last chunk of a stream carries `finish_reason`."""

    token_ids: list[int]
    text: str
    prefix_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    def __init__(self, engine_dir: str | Path):
        self.engine = Engine(engine_dir)
        self.tokenizer = self.engine.tokenizer
        self.limits = self.engine.limits
        self._cache = KVCache(self.engine.spec, self.limits.max_seq_len, self.engine.dtype)
        self._lock = threading.Lock()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt).ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        limits = self.limits
        if not prompt_ids:
            raise RequestError("the prompt is empty (0 tokens)")
        if len(prompt_ids) > limits.max_input_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, over this engine's max_input_len "
                f"{limits.max_input_len}"
            )
        if len(prompt_ids) + params.max_tokens > limits.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt_ids) + params.max_tokens}, over this engine's max_seq_len "
                f"{limits.max_seq_len}"
            )
        vocab = self.engine.spec.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        if params.ignore_eos:
            return set()
        if params.end_id is not None:
            return {params.end_id}
        return set(self.engine.spec.eos_ids)

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, **overrides
    ) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are sampled. Raises RequestError before the first chunk."""
        params = replace(params or SamplingParams(), **overrides)
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(prompt_ids, params)
        return self._run(prompt_ids, params)

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        sample = Sampler(params)
        stop_ids = self._stop_ids(params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        model, cache = self.engine.model, self._cache
        with self._lock:
            logits = model.forward(torch.tensor(prompt_ids), 0, cache)
            position, generated, finish = len(prompt_ids), 0, FINISH_LENGTH
            while True:
                token = sample(logits)
                if token in stop_ids:
                    finish, last = FINISH_STOP, detok.add([], final=True)
                    break
                generated += 1
                done = generated == params.max_tokens
                emitted = detok.add([token], final=done)
                if done:
                    last = emitted
                    break
                if emitted:
                    yield StreamChunk(emitted[1], emitted[2], emitted[0])
                logits = model.forward(torch.tensor([token]), position, cache)
                position += 1
        # the last chunk: whatever is still pending (possibly nothing) and why the stream ended
        prefix, tokens, text = last or ([], [], "")
        yield StreamChunk(tokens, text, prefix, finish)

    def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, **overrides
    ) -> GenerationOutput:
        """Generate for one prompt; the text is exactly what a stream of it would carry."""
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids: list[int] = []
        text: list[str] = []
        finish = FINISH_LENGTH
        for chunk in self.stream(prompt_ids, params, **overrides):
            token_ids += chunk.token_ids
            text.append(chunk.text)
            finish = chunk.finish_reason or finish
        return GenerationOutput(prompt_ids, token_ids, "".join(text), finish)
