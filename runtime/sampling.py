"""Sampling parameters, logits processing and the sampler.

Per request, in this order (TensorRT-LLM's): embedding bias; repetition, presence and
frequency penalties over every token so far (prompt included, as TensorRT-LLM counts them);
bad words; end ids masked until min_tokens are out. Then greedy, or temperature, top-k,
top-p and a per-request seeded draw. Stop words are checked by the executor after a token
is appended."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import RequestError

Words = tuple[tuple[int, ...], ...]  # token sequences (stop words, bad words)
GREEDY_BELOW = 1e-5  # a temperature under this is decoded greedily (dividing by it overflows)


def greedy_tokens(logits: torch.Tensor) -> list[int] | int:
    """Each row's argmax (an int for 1-D logits): the first of equal maxima, and the first NaN
    where a row has one, as torch.argmax. Through NumPy, whose argmax is vectorized: torch's CPU
    argmax reads ~2 ns an element (~90-115 µs a row of 49,152 logits against 6-8; benchmarks/greedy_argmax.py)."""
    return logits.detach().float().contiguous().numpy().argmax(axis=-1).tolist()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. temperature 0 (the default; or anything under
    GREEDY_BELOW) is greedy decoding. Every number is checked here, so a request's values
    cannot fail a step that other requests share."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # None: the model's end-of-sequence ids
    ignore_eos: bool = False
    min_tokens: int = 0  # end ids cannot be sampled before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens already present (HF/TensorRT-LLM form)
    presence_penalty: float = 0.0  # subtracted once from every present token's logit
    frequency_penalty: float = 0.0  # subtracted once per occurrence
    stop_words: Words = ()  # generation ends after any of these sequences (kept in the output)
    bad_words: Words = ()  # sequences that can never be completed
    embedding_bias: tuple[float, ...] | None = field(default=None, repr=False)  # added to the logits
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False

    def __post_init__(self):
        finite = {name: getattr(self, name) for name in ("temperature", "top_p", "repetition_penalty",
                                                         "presence_penalty", "frequency_penalty")}
        for name, value in finite.items():
            if not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value}")
        if self.embedding_bias is not None and any(math.isnan(v) or v == math.inf for v in self.embedding_bias):
            raise RequestError("embedding_bias must hold numbers or -inf (to ban a token), not NaN or +inf")
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(self.stop_words), "stop_words must not contain an empty sequence"),
            (all(self.bad_words), "bad_words must not contain an empty sequence"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """True when this request's logits need more than argmax/temperature/top-k/top-p."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.bad_words or self.min_tokens or self.embedding_bias is not None)

    @property
    def plain_greedy(self) -> bool:
        """Served by one batched argmax: nothing per request to compute."""
        return (self.greedy and not self.processes_logits and not self.return_log_probs
                and not self.return_generation_logits)


def process_logits(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_generated: int,
                   end_ids: frozenset[int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """One row of float32 logits after the request's bias (params.embedding_bias as a tensor,
    made once per request by its Sampler), penalties, bad words and min_tokens."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if bias is not None:
        logits += bias
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(torch.tensor(token_ids, dtype=torch.int64), minlength=vocab)[:vocab]
        present = counts > 0
        if params.repetition_penalty != 1.0:
            seen = logits[present]
            logits[present] = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
        if params.presence_penalty:
            logits -= params.presence_penalty * present.to(logits.dtype)
        if params.frequency_penalty:
            logits -= params.frequency_penalty * counts.to(logits.dtype)
    for word in params.bad_words:
        head = list(word[:-1])
        if not head or token_ids[-len(head):] == head:
            logits[word[-1]] = float("-inf")
    if num_generated < params.min_tokens:
        for end in end_ids:
            logits[end] = float("-inf")
    return logits


def ends_with_stop_word(token_ids: list[int], params: SamplingParams) -> bool:
    return any(token_ids[-len(word):] == list(word) for word in params.stop_words)


class Sampler:
    """Samples one token id from a float32 logits row; one instance per request (owns its RNG)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.bias = None if params.embedding_bias is None else torch.tensor(params.embedding_bias)
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def distribution_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the draw is made from (before top-k/top-p): temperature applied."""
        return logits if self.params.greedy else logits / self.params.temperature

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return greedy_tokens(logits)
        logits = self.distribution_logits(logits)
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the first over top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
