"""ModelSpec: the architecture constants of a Llama-family model, as stored in engine.json."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    head_norms: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_id: int | None = None
    sliding_window: int | None = None  # Mistral; the build rejects max_seq_len beyond it
    # llama.cpp's per-pair rope frequency divisors (a GGUF's rope_freqs.weight: how its converter
    # stores Llama 3 scaling), instead of rope_scaling
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["eos_ids"] = list(self.eos_ids)
        if self.rope_freq_factors is not None:
            data["rope_freq_factors"] = list(self.rope_freq_factors)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ModelSpec":
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_ids"] = tuple(data.get("eos_ids", ()))
        if data.get("rope_freq_factors") is not None:
            data["rope_freq_factors"] = tuple(data["rope_freq_factors"])
        return cls(**data)
