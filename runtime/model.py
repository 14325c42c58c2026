"""kiln's Llama-family model: one definition for calibration, tests and serving.

Linear layers run through PyTorch; RMSNorm and attention (with its KV-cache write) are the
plugin ops. Weights arrive already packed by the builder (QKV fused, gate/up fused)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.plugins import ops
from kiln.runtime.rope import apply_rope, cos_sin_tables
from kiln.runtime.spec import ModelSpec


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class StepContext:
    """Attention metadata for one step of a packed batch (nano-vllm style): sequence s owns
    the tokens [query_start[s], query_start[s+1]) at positions context_lens[s] + 0, 1, ...;
    logits are computed only for the rows in `logits_rows`."""

    positions: torch.Tensor  # [tokens] int64
    query_start: torch.Tensor  # [seqs + 1] int32
    context_lens: torch.Tensor  # [seqs] int32
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    logits_rows: torch.Tensor  # [rows] int64

    @classmethod
    def single(cls, start: int, count: int, block_table: list[int], all_logits: bool = False):
        """One sequence: `count` new tokens after `start` cached ones."""
        rows = torch.arange(count) if all_logits else torch.tensor([count - 1])
        return cls(
            positions=torch.arange(start, start + count),
            query_start=torch.tensor([0, count], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            block_tables=torch.tensor([block_table], dtype=torch.int32),
            logits_rows=rows,
        )


class KVPool:
    """The key/value blocks: per layer [num_blocks, block_size, kv_heads, head_dim]. One
    allocation, left uninitialized: attention reads only slots written before, and pages the
    pool never touches cost no memory."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.storage = torch.empty(spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads,
                                   spec.head_dim, dtype=dtype)
        self.keys = [self.storage[i, 0] for i in range(spec.num_layers)]
        self.values = [self.storage[i, 1] for i in range(spec.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * element


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int):
        self.spec = spec
        self.dtype = weights[names.EMBED].dtype
        self.embed = weights[names.EMBED]
        self.final_norm = weights[names.FINAL_NORM]
        self.lm_head = self.embed if spec.tie_embeddings else weights[names.LM_HEAD]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.cos, self.sin = cos_sin_tables(spec, max_positions, self.dtype)
        self.scale = spec.head_dim**-0.5

    @staticmethod
    def _layer(weights: dict[str, torch.Tensor], i: int) -> Layer:
        def get(name: str) -> torch.Tensor:
            return weights[names.layer_tensor(i, name)]

        return Layer(
            input_norm=get(names.INPUT_NORM),
            qkv=get(names.ATTN_QKV),
            qkv_bias=weights.get(names.layer_tensor(i, names.ATTN_QKV_BIAS)),
            out=get(names.ATTN_OUT),
            post_attention_norm=get(names.POST_ATTENTION_NORM),
            gate_up=get(names.MLP_GATE_UP),
            down=get(names.MLP_DOWN),
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: StepContext, pool: KVPool) -> torch.Tensor:
        """Run a packed batch of tokens (1-D); float32 logits [len(ctx.logits_rows), vocab]."""
        spec = self.spec
        count = tokens.shape[0]
        cos, sin = self.cos[ctx.positions], self.sin[ctx.positions]
        eps = spec.norm_eps
        h = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            x = ops.rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((spec.q_size, spec.kv_size, spec.kv_size), dim=-1)
            q = apply_rope(q.view(count, spec.num_heads, spec.head_dim), cos, sin)
            k = apply_rope(k.view(count, spec.num_kv_heads, spec.head_dim), cos, sin)
            v = v.reshape(count, spec.num_kv_heads, spec.head_dim)
            attn = ops.paged_attention(q, k, v, pool.keys[index], pool.values[index], ctx.block_tables,
                                       ctx.query_start, ctx.context_lens, self.scale)
            h = h + F.linear(attn.view(count, spec.q_size), layer.out)
            x = ops.rms_norm(h, layer.post_attention_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = ops.rms_norm(h[ctx.logits_rows], self.final_norm, eps)
        return F.linear(h, self.lm_head).float()
