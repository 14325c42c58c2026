"""Calibration: run kiln's own model (float32, unquantized) over the calibration text and
record what each linear layer sees, in bounded memory.

Per linear input channel: the maximum |x| (SmoothQuant) and the mean |x| (AWQ), plus a
sample of at most `rows` input rows (AWQ's search measures output error on them). The first
token of every sequence is always in the sample: its activations are by far the largest (the
attention sink every later token reads) and a search that never sees it clips the weights
that carry it. Measured on SmolLM2 int4 AWQ, group 64 (the build's report on 4,096 held-out
tokens, with and without the `picked[0] = 0` line below): +33% perplexity without it, +16% with.

Per layer, for a quantized KV cache: the largest |k| and |v| per channel, from the qkv
projection's output. Keys are stored after rotary embedding, which mixes channel d with
d + head_dim / 2; |rotated k_d| never exceeds the pair's norm sqrt(k_d^2 + k_{d+half}^2), so
that norm's maximum is taken for both channels of the pair (no key saturates at any position).
For a cache whose keys are also multiplied by the Hadamard matrix H after RoPE
(runtime/key_rotation.py), channel i of H R k is a sum over the pairs p of a rotating 2-vector
of length |pair p| * sqrt(H[i, p]^2 + H[i, p + half]^2); the sum of those lengths bounds it at
every position, and its maximum over the tokens is kept too (k_hadamard_absmax).

GPTQ rounding also needs each linear's x^T x over every token ([in, in] float32: 400 MB for
SmolLM2, about 22 GB for a 7B Llama). Those sums are held for a chunk of consecutive layers
within GRAM_BUDGET at a time: the first chunk's during the calibration pass, each later chunk's
by another pass over the calibration text that stops after the chunk's last layer. x^T x is
symmetric, so only its blocks on and above the diagonal are summed (add_gram: 10 of 16), the
rest mirrored once at the end (whole_gram): the full product costs about as much as the
calibration's forward pass itself.

Mixture-of-Experts layers: each expert's linears get statistics of the tokens routed to them.
An expert that calibration routed fewer than MIN_EXPERT_TOKENS tokens to has too few for a
search; it takes the statistics of every token instead (its gate/up projection sees the
MLP input of all tokens; its down projection the activations its own gate/up weights make of
them), is marked `pooled` (GPTQ rounds it to nearest: no x^T x of its own) and is listed in
the layer's ExpertRouting, which the build reports."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kiln.plugins.formats import hadamard_matrix
from kiln.runtime.model import LINEARS, KVPool, Layer, LlamaModel, StepContext, expert_key

GRAM_BUDGET = 2 << 30  # bytes of x^T x sums held at once
GRAM_BLOCKS = 4  # add_gram's column blocks
HEAD_STATS = (-1, "lm_head")  # calibrate()'s key for the output projection's input (the final norm's output)
EXPERTS = "experts"  # calibrate()'s key (layer index, EXPERTS) for a Mixture-of-Experts layer's ExpertRouting
MIN_EXPERT_TOKENS = 32  # an expert routed fewer calibration tokens takes every token's statistics


def add_gram(gram: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gram += x^T x for x [tokens, in], on and above the diagonal only (GRAM_BLOCKS column blocks,
    each times itself and the blocks right of it); whole_gram fills in the rest."""
    n = x.shape[1]
    edges = [round(i * n / GRAM_BLOCKS) for i in range(GRAM_BLOCKS + 1)]
    for start, end in zip(edges, edges[1:]):
        gram[start:end, start:].addmm_(x[:, start:end].T, x[:, start:])
    return gram


def whole_gram(gram: torch.Tensor) -> torch.Tensor:
    """The sums add_gram left above the diagonal, mirrored below it (in place)."""
    return gram.copy_(torch.triu(gram) + torch.triu(gram, 1).T)


@dataclass
class LinearStats:
    absmax: torch.Tensor  # [in]
    abssum: torch.Tensor  # [in]
    count: int = 0
    parts: list[torch.Tensor] = field(default_factory=list)  # sampled rows, call by call
    rows: torch.Tensor | None = None  # [<= rows, in]: the sample, once calibration is done
    gram: torch.Tensor | None = None  # [in, in]: sum of x^T x over every token (GPTQ), when asked for
    pooled: bool = False  # an expert's, from every token rather than those routed to it (module docstring)

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.count, 1)


@dataclass
class ExpertRouting:
    """How calibration routed a Mixture-of-Experts layer's tokens."""

    tokens: list[int]  # calibration tokens each expert ran on
    pooled: list[int]  # the experts under MIN_EXPERT_TOKENS, whose statistics are every token's

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "pooled": self.pooled}


@dataclass
class KVStats:
    k_absmax: torch.Tensor  # [kv_heads * head_dim], bounds the keys after RoPE
    v_absmax: torch.Tensor  # [kv_heads * head_dim]
    k_hadamard_absmax: torch.Tensor  # [kv_heads * head_dim], bounds them after RoPE and the key rotation

    @classmethod
    def empty(cls, kv_size: int) -> KVStats:
        return cls(torch.zeros(kv_size), torch.zeros(kv_size), torch.zeros(kv_size))


class Observer:
    """Stands in for a linear layer during calibration: records its input, then calls it."""

    def __init__(self, inner, stats: LinearStats, rows_per_call: int, generator: torch.Generator, kv=None):
        self.inner, self.stats, self.rows_per_call, self.generator = inner, stats, rows_per_call, generator
        self.kv = kv  # called with the output (the qkv projection: KV-cache statistics)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """-> the inner linear's output (no inner: an empty [rows, 0], for the output projection,
        whose logits calibration never needs)."""
        xf = x.float()
        a = xf.abs()
        self.stats.absmax = torch.maximum(self.stats.absmax, a.amax(dim=0))
        self.stats.abssum += a.sum(dim=0)
        self.stats.count += xf.shape[0]
        if self.stats.gram is not None:
            add_gram(self.stats.gram, xf)
        take = min(self.rows_per_call, xf.shape[0])
        picked = torch.randperm(xf.shape[0], generator=self.generator)[:take]
        picked[0] = 0  # the sequence's first token: see the module docstring
        self.stats.parts.append(xf[picked].clone())
        if self.inner is None:
            return x[:, :0]
        out = self.inner(x)
        if self.kv is not None:
            self.kv(out)
        return out


def kv_observer(stats: KVStats, q_size: int, kv_size: int, head_dim: int):
    """Records the K / V ranges of a qkv projection's output."""
    half = head_dim // 2
    h = hadamard_matrix(head_dim)
    reach = (h[:, :half].pow(2) + h[:, half:].pow(2)).sqrt()  # [head_dim, half]: H's weight on each pair

    def observe(qkv: torch.Tensor) -> None:
        k = qkv[:, q_size:q_size + kv_size].float()
        v = qkv[:, q_size + kv_size:].float()
        heads = k.reshape(k.shape[0], -1, 2, half)  # [tokens, kv_heads, (first, second) half, half]
        pairs = heads.pow(2).sum(dim=2).sqrt()  # [tokens, kv_heads, half]
        stats.k_absmax = torch.maximum(stats.k_absmax, pairs.amax(dim=0).repeat(1, 2).reshape(-1))
        rotated = torch.einsum("tgp,ip->tgi", pairs, reach).amax(dim=0)  # [kv_heads, head_dim]
        stats.k_hadamard_absmax = torch.maximum(stats.k_hadamard_absmax, rotated.reshape(-1))
        stats.v_absmax = torch.maximum(stats.v_absmax, v.abs().amax(dim=0))

    return observe


@contextmanager
def observing(model: LlamaModel, observers: dict[tuple[int, str], object]):
    """(layer index, linear key as Layer.linears() names it) -> a callable standing in for that
    linear while the block runs (HEAD_STATS: for the output projection); the linears are put
    back however it ends."""
    def put(index: int, key: str, linear) -> None:
        if index == HEAD_STATS[0]:
            model.lm_head = linear
        else:
            model.layers[index].set_linear(key, linear)

    originals = {(index, key): model.lm_head if index == HEAD_STATS[0] else model.layers[index].linears()[key]
                 for index, key in observers}
    for (index, key), observer in observers.items():
        put(index, key, observer)
    # the observers run only in the Python loop
    fused, model.fused_decode, experts, model.fused_experts = model.fused_decode, False, model.fused_experts, False
    try:
        yield
    finally:
        model.fused_decode, model.fused_experts = fused, experts
        for (index, key), inner in originals.items():
            put(index, key, inner)


def run_sequence(model: LlamaModel, ids: list[int], block_size: int, all_rows: bool = False) -> None:
    """One calibration sequence through the model, in a KV pool of its own (all_rows: every
    position goes to the output projection, not only the last)."""
    blocks = -(-len(ids) // block_size)
    pool = KVPool(model.spec, blocks, block_size, model.kv_dtype)
    model.forward(torch.tensor(ids), StepContext.single(0, len(ids), list(range(blocks)), all_rows), pool)


def calibrate(model: LlamaModel, sequences: list[list[int]], rows: int = 256, block_size: int = 32,
              progress: Callable[[], None] = lambda: None,
              gram_layers: range = range(0)) -> dict[tuple[int, str], LinearStats | KVStats]:
    """(layer index, linear name) -> statistics of its input over every calibration token, and
    (layer index, "kv") -> the layer's K / V ranges; x^T x too for the layers in `gram_layers`.
    HEAD_STATS -> the output projection's input, with its x^T x (small: hidden_size squared)."""
    generator = torch.Generator().manual_seed(0)
    rows_per_call = max(1, -(-rows // len(sequences)))
    stats: dict[tuple[int, str], LinearStats] = {}
    observers = {}
    for index, layer in enumerate(model.layers):
        for name, inner in layer.linears().items():
            in_features = inner.weight.shape[1]
            stats[index, name] = LinearStats(torch.zeros(in_features), torch.zeros(in_features),
                                             gram=torch.zeros(in_features, in_features) if index in gram_layers
                                             else None)
            kv = None
            if name == "qkv":
                spec = model.spec
                stats[index, "kv"] = KVStats.empty(spec.kv_size)
                kv = kv_observer(stats[index, "kv"], spec.q_size, spec.kv_size, spec.head_dim)
                if spec.head_norms:  # the cache holds the keys after Qwen3's head norms
                    kv = (lambda out, observe=kv, layer=layer: observe(model.norm_heads(out, layer)))
            observers[index, name] = Observer(inner, stats[index, name], rows_per_call, generator, kv)
    hidden = model.spec.hidden_size
    stats[HEAD_STATS] = LinearStats(torch.zeros(hidden), torch.zeros(hidden), gram=torch.zeros(hidden, hidden))
    observers[HEAD_STATS] = Observer(None, stats[HEAD_STATS], rows_per_call, generator)
    with observing(model, observers):
        for ids in sequences:
            run_sequence(model, ids, block_size, all_rows=True)
            progress()
    for s in stats.values():
        if isinstance(s, LinearStats):
            s.rows, s.parts = (torch.cat(s.parts)[:rows] if s.parts else None), []
            if s.gram is not None:
                whole_gram(s.gram)
    for index, layer in enumerate(model.layers):
        if layer.experts:
            routing, settled = settle_experts(model, layer, {key: value for (i, key), value in stats.items()
                                                             if i == index}, rows, generator)
            stats[index, EXPERTS] = routing
            stats.update({(index, key): value for key, value in settled.items()})
    return stats


def settle_experts(model: LlamaModel, layer: Layer, stats: dict[str, LinearStats], rows: int,
                   generator: torch.Generator) -> tuple[ExpertRouting, dict[str, LinearStats]]:
    """A Mixture-of-Experts layer's routing, and every-token statistics by linear key for the
    experts calibration routed fewer than MIN_EXPERT_TOKENS tokens to (module docstring)."""
    entry = [stats[expert_key(e, "gate_up")] for e in range(len(layer.experts))]
    routing = ExpertRouting([s.count for s in entry], [e for e, s in enumerate(entry) if s.count < MIN_EXPERT_TOKENS])
    settled: dict[str, LinearStats] = {}
    if not routing.pooled:
        return routing, settled
    # each token runs top-k experts: their inputs together are every token's, each k times
    every = torch.cat([s.rows for s in entry if s.rows is not None])
    picked = torch.randperm(every.shape[0], generator=generator)[:rows]
    absmax = torch.stack([s.absmax for s in entry]).amax(dim=0)
    abssum, count = sum(s.abssum for s in entry), sum(s.count for s in entry)
    for e in routing.pooled:
        hidden = model.activation(layer.experts[e].gate_up(every)).float()  # what its down projection would see
        a = hidden.abs()
        settled[expert_key(e, "gate_up")] = LinearStats(absmax.clone(), abssum.clone(), count, rows=every[picked],
                                                        pooled=True)
        settled[expert_key(e, "down")] = LinearStats(a.amax(dim=0), a.sum(dim=0), hidden.shape[0],
                                                     rows=hidden[picked], pooled=True)
    return routing, settled


def gram_chunks(model: LlamaModel, budget: int = GRAM_BUDGET) -> list[range]:
    """Consecutive layers whose linears' x^T x sums (float32) fit in `budget` together (a layer
    that alone is over it is a chunk of its own)."""
    chunks, start, held = [], 0, 0
    for index, layer in enumerate(model.layers):
        size = sum(linear.weight.shape[1] ** 2 * 4 for linear in layer.linears().values())
        if index > start and held + size > budget:
            chunks.append(range(start, index))
            start, held = index, 0
        held += size
    chunks.append(range(start, len(model.layers)))
    return chunks


class _ChunkDone(Exception):
    pass


class GramObserver:
    """Stands in for a linear layer: adds x^T x to `gram`, then calls it."""

    def __init__(self, inner, gram: torch.Tensor):
        self.inner, self.gram = inner, gram

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        add_gram(self.gram, x.float())
        return self.inner(x)


def _stop(x: torch.Tensor) -> torch.Tensor:
    """Stands in for the first linear after a chunk of layers: the forward pass ends there."""
    raise _ChunkDone


def gram_sums(model: LlamaModel, sequences: list[list[int]], layers: range,
              block_size: int = 32) -> dict[tuple[int, str], torch.Tensor]:
    """x^T x of every linear's input in `layers`, over the calibration sequences (one forward
    pass each, stopped at the next layer's first linear)."""
    grams: dict[tuple[int, str], torch.Tensor] = {}
    observers = {}
    for index in layers:
        for key, inner in model.layers[index].linears().items():
            grams[index, key] = torch.zeros(inner.weight.shape[1], inner.weight.shape[1])
            observers[index, key] = GramObserver(inner, grams[index, key])
    if layers[-1] + 1 < len(model.layers):
        observers[layers[-1] + 1, LINEARS[0]] = _stop
    with observing(model, observers):
        for ids in sequences:
            try:
                run_sequence(model, ids, block_size)
            except _ChunkDone:
                pass
    return {key: whole_gram(gram) for key, gram in grams.items()}


class Grams:
    """x^T x per (layer, linear) for GPTQ, one chunk of layers (gram_chunks) held at a time: the
    chunk the calibration pass summed (taken out of `stats`), later chunks by gram_sums when first
    asked for. Ask in layer order."""

    def __init__(self, model: LlamaModel, sequences: list[list[int]], stats: dict, budget: int = GRAM_BUDGET):
        self.model, self.sequences, self.chunks = model, sequences, gram_chunks(model, budget)
        self.held: dict[tuple[int, str], torch.Tensor] = {}
        for key, value in stats.items():
            if isinstance(value, LinearStats) and value.gram is not None and key != HEAD_STATS:
                self.held[key], value.gram = value.gram, None
        self.passes = 0  # extra passes over the calibration text

    def __call__(self, layer: int, name: str) -> torch.Tensor:
        if (layer, name) not in self.held:
            self.held = {}  # free the previous chunk first
            chunk = next(c for c in self.chunks if layer in c)
            self.held = gram_sums(self.model, self.sequences, chunk)
            self.passes += 1
        return self.held[layer, name]
