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


class KVCache:
    """One sequence's keys and values: per layer [max_seq_len, kv_heads, head_dim]."""

    def __init__(self, spec: ModelSpec, max_seq_len: int, dtype: torch.dtype):
        shape = (max_seq_len, spec.num_kv_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.max_seq_len = max_seq_len


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int):
        self.spec = spec
        self.dtype = weights[names.EMBED].dtype
        self.embed = weights[names.EMBED]
        self.final_norm = weights[names.FINAL_NORM]
        self.lm_head = self.embed if spec.tie_embeddings else weights[names.LM_HEAD]
        self.layers = [self._layer(weights, i) for i in range(spec.num_layers)]
        self.cos, self.sin = cos_sin_tables(spec, max_seq_len, self.dtype)
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
    def forward(
        self, tokens: torch.Tensor, start_pos: int, cache: KVCache, all_logits: bool = False
    ) -> torch.Tensor:
        """Run `tokens` (1-D) at positions start_pos.. of one sequence; float32 logits of the
        last token ([vocab]) or of every token ([tokens, vocab])."""
        spec = self.spec
        count = tokens.shape[0]
        positions = slice(start_pos, start_pos + count)
        cos, sin = self.cos[positions], self.sin[positions]
        eps = spec.norm_eps
        h = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            x = ops.rms_norm(h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split((spec.q_size, spec.kv_size, spec.kv_size), dim=-1)
            q = apply_rope(q.view(count, spec.num_heads, spec.head_dim), cos, sin)
            k = apply_rope(k.view(count, spec.num_kv_heads, spec.head_dim), cos, sin)
            v = v.reshape(count, spec.num_kv_heads, spec.head_dim)
            attn = ops.attention(
                q, k, v, cache.keys[index], cache.values[index], start_pos, self.scale
            )
            h = h + F.linear(attn.view(count, spec.q_size), layer.out)
            x = ops.rms_norm(h, layer.post_attention_norm, eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = ops.rms_norm(h if all_logits else h[-1:], self.final_norm, eps)
        logits = F.linear(h, self.lm_head).float()
        return logits if all_logits else logits[0]
