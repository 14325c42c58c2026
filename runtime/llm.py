"""The Python API: `LLM(engine_dir).generate(...)` and streaming with `LLM.stream(...)`.

Both run on the Executor, so concurrent callers (threads, the Triton model) are batched
together by in-flight batching."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kiln.errors import RequestError
from kiln.runtime.detokenizer import IncrementalDetokenizer, TokenBytes
from kiln.runtime.engine import read_engine_json
from kiln.runtime.executor import FINISH_ERROR, Executor, Response
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.sampling import SamplingParams

Prompt = str | list[int]


@dataclass
class StreamChunk:
    """New tokens and the text they add; `prefix_ids` are the tokens decoding needs before
    them (see detokenizer). The last chunk of a stream carries `finish_reason`."""

    token_ids: list[int]
    text: str
    prefix_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # when the request asked for them (SamplingParams.return_*): one per token of this chunk
    log_probs: list[float] = field(default_factory=list)
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    context_logits: torch.Tensor | None = None  # [prompt, vocab]: on the first chunk


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    log_probs: list[float] = field(default_factory=list)
    generation_logits: torch.Tensor | None = None  # [tokens, vocab]
    context_logits: torch.Tensor | None = None

    @property
    def cum_log_prob(self) -> float:
        return sum(self.log_probs)


class ChunkAssembler:
    """Turns one request's executor responses into text chunks that never split a character;
    per-token extras (log probs, logits) travel with their tokens. With token_bytes (a caller
    that decodes the text elsewhere, as Triton's postprocessing does) the chunks are cut the same
    way without making their text: StreamChunk.text stays empty."""

    def __init__(self, tokenizer, prompt_ids: list[int], token_bytes: TokenBytes | None = None):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, token_bytes)
        self.log_probs: list[float] = []
        self.generation_logits: list[torch.Tensor] = []
        self.context_logits: torch.Tensor | None = None

    def add(self, response: Response) -> StreamChunk | None:
        self.log_probs += response.log_probs
        self.generation_logits += response.generation_logits
        if response.context_logits is not None:
            self.context_logits = response.context_logits
        emitted = self.detok.add(response.token_ids, final=response.finished)
        if response.finished:
            emitted = emitted or ([], [], "")
        if emitted is None:
            return None
        prefix, tokens, text = emitted
        chunk = StreamChunk(tokens, text or "", prefix, response.finish_reason, self.log_probs, self.generation_logits,
                            self.context_logits)
        self.log_probs, self.generation_logits, self.context_logits = [], [], None
        return chunk


class LLM:
    def __init__(self, engine_dir: str | Path, **runtime_overrides):
        """runtime_overrides: kv_cache_memory, scheduler, enable_prefix_reuse, max_queue_size
        (defaults: the engine's build config)."""
        meta = read_engine_json(Path(engine_dir))
        options = RuntimeOptions.from_engine(meta.get("runtime", {}), **runtime_overrides)
        self.executor = Executor(engine_dir, options)  # loads the engine on its own thread
        self.engine = self.executor.engine
        self.tokenizer = self.engine.tokenizer
        self.limits = self.engine.limits

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, overrides: dict) -> tuple[int, list[int]]:
        params = replace(params or SamplingParams(), **overrides)
        prompt_ids = self.encode(prompt)
        return self.executor.enqueue(prompt_ids, params), prompt_ids

    def _chunks(self, request_id: int, prompt_ids: list[int]) -> Iterator[StreamChunk]:
        assembler = ChunkAssembler(self.tokenizer, prompt_ids)
        finished = False
        try:
            while not finished:
                for response in self.executor.await_responses(request_id):
                    if response.finish_reason == FINISH_ERROR:
                        finished = True
                        raise RequestError(response.error)
                    finished = response.finished
                    chunk = assembler.add(response)
                    if chunk is not None:
                        yield chunk
        finally:
            if not finished:  # the caller stopped early: free the request's blocks
                self.executor.cancel(request_id)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **overrides) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are sampled. A request the engine can never serve raises
        RequestError here; one refused later (busy) raises it from the iterator."""
        request_id, prompt_ids = self._submit(prompt, params, overrides)
        return self._chunks(request_id, prompt_ids)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None,
                 **overrides) -> GenerationOutput | list[GenerationOutput]:
        """Generate for one prompt or a list of prompts (run together, batched in flight).
        The text is exactly what a stream of the same request carries."""
        single = isinstance(prompts, str) or not prompts or isinstance(prompts[0], int)
        batch = [prompts] if single else list(prompts)
        submitted = [self._submit(p, params, overrides) for p in batch]
        outputs = [self._collect(request_id, prompt_ids) for request_id, prompt_ids in submitted]
        return outputs[0] if single else outputs

    def _collect(self, request_id: int, prompt_ids: list[int]) -> GenerationOutput:
        out = GenerationOutput(prompt_ids, [], "", "")
        text: list[str] = []
        logits: list[torch.Tensor] = []
        for chunk in self._chunks(request_id, prompt_ids):
            out.token_ids += chunk.token_ids
            text.append(chunk.text)
            out.finish_reason = chunk.finish_reason or out.finish_reason
            out.log_probs += chunk.log_probs
            logits += chunk.generation_logits
            if chunk.context_logits is not None:
                out.context_logits = chunk.context_logits
        out.text = "".join(text)
        if logits:
            out.generation_logits = torch.stack(logits)
        return out

    def stats(self) -> dict:
        return self.executor.stats()

    def close(self) -> None:
        """Stop the executor thread (the engine's memory is freed once the LLM is dropped)."""
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
