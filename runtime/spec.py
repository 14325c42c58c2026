"""ModelSpec: the architecture constants of a model of kiln's one decoder definition (the Llama
family and the options that make Qwen3, Phi-3, Gemma 3 and the Mixture-of-Experts families of
it), as stored in engine.json."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
# what head_norms normalize: each query / key head (Qwen3, Gemma 3), or the whole query and key
# projections, all heads together (OLMoE)
HEAD_NORM_SPANS = ("head", "projection")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gated activation: SwiGLU, or GeGLU with tanh-GELU (Gemma)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's long-context RoPE (rope_type "longrope"): per-frequency divisors for contexts up to
    original_max_position_embeddings (short) and beyond (long), and a factor on cos and sin. An
    engine whose max_seq_len exceeds original_max_position_embeddings uses the long divisors at
    every position (transformers switches to them once a sequence grows past it); else the short."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    def __post_init__(self):  # (from JSON: lists)
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    head_norms: bool = False  # Qwen3, Gemma 3, OLMoE: RMSNorm of the queries and keys before RoPE
    head_norms_span: str = "head"  # one of HEAD_NORM_SPANS: over each head, or over all heads at once
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_id: int | None = None
    # a token attends to its last `sliding_window` positions only (Mistral, Phi-3, Gemma 3's local
    # layers), on every layer but full_attention_layers
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    # llama.cpp's per-pair rope frequency divisors (a GGUF's rope_freqs.weight: how its converter
    # stores Llama 3 scaling), instead of rope_scaling
    rope_freq_factors: tuple[float, ...] | None = None
    rope_linear_factor: float | None = None  # "linear" rope scaling: positions / factor (not on local layers)
    rope_longrope: LongRope | None = None  # Phi-3's long-context RoPE
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): the first rotary_dim values of each head rotate
    local_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' own RoPE base
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype
    query_scale: float | None = None  # attention scores' scale (Gemma 3: query_pre_attn_scalar^-0.5); else head_dim^-0.5
    output_norms: bool = False  # Gemma: RMSNorms of the attention's and the MLP's outputs before each residual add
    activation: str = "silu"  # one of ACTIVATIONS
    # Mixture-of-Experts (Mixtral, Qwen3-MoE): each layer's MLP is num_experts experts of
    # expert_intermediate_size, of which a router picks experts_per_token for each token
    num_experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True  # the top-k softmax weights rescaled to sum to 1
    round_expert_weights: bool = False  # the weights rounded to the model dtype before use (Qwen3-MoE)
    # a shared expert every token runs beside the routed ones (Qwen2-MoE), a gated MLP of this width
    # (0: none), its output times sigmoid(x @ shared_gate.T) if shared_expert_gated
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_norms_span not in HEAD_NORM_SPANS:
            raise ValueError(f"head_norms_span {self.head_norms_span!r} is not one of {HEAD_NORM_SPANS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be at least 1 (or None)")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts and self.expert_intermediate_size > 0):
            raise ValueError(f"a Mixture-of-Experts model needs 0 < experts_per_token ({self.experts_per_token}) <= "
                             f"num_experts ({self.num_experts}) and an expert_intermediate_size")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"full_attention_layers {bad} are not layers of a {self.num_layers}-layer model")

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to every earlier position)."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return 0
        return self.sliding_window

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    @property
    def head_norm_sizes(self) -> tuple[int, int]:
        """The lengths of the query and key norms' weights."""
        if self.head_norms_span == "projection":
            return self.q_size, self.kv_size
        return self.head_dim, self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["eos_ids"] = list(self.eos_ids)
        data["full_attention_layers"] = list(self.full_attention_layers)
        if self.rope_freq_factors is not None:
            data["rope_freq_factors"] = list(self.rope_freq_factors)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ModelSpec":
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        if data.get("rope_longrope"):
            data["rope_longrope"] = LongRope(**data["rope_longrope"])
        data["eos_ids"] = tuple(data.get("eos_ids", ()))
        data["full_attention_layers"] = tuple(data.get("full_attention_layers", ()))
        if data.get("rope_freq_factors") is not None:
            data["rope_freq_factors"] = tuple(data["rope_freq_factors"])
        return cls(**data)
