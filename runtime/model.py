"""kiln's Llama-family model: one definition for calibration, tests and serving.

Linear layers run through PyTorch; RMSNorm and attention (with its KV-cache write) are the
plugin ops. Weights arrive already packed by the builder (QKV fused, gate/up fused)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.plugins import ops
from kiln.runtime.rope import cos_sin_tables
from kiln.runtime.spec import ModelSpec

SKINNY_ROWS = 8  # up to this many bf16 rows take the GEMV plugin (measured: 1.2x at 4 streams)


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

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A few bf16 rows (decode steps of small batches) go to kiln's GEMV, which streams the
        weights once at memory bandwidth (2-3x PyTorch's at one row here); everything else to
        PyTorch's GEMM. float32 always uses PyTorch's, whose results do not depend on the
        batch size."""
        if x.shape[0] <= SKINNY_ROWS and x.dtype == torch.bfloat16:
            return ops.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: StepContext, pool: KVPool) -> torch.Tensor:
        """Run a packed batch of tokens (1-D); float32 logits [len(ctx.logits_rows), vocab].

        Per layer: 4 GEMMs and 3 plugin ops: the residual add fused into RMSNorm,
        rotary embedding + KV write + attention in one, SwiGLU in one."""
        spec = self.spec
        eps = spec.norm_eps
        h = F.embedding(tokens, self.embed)
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)
            attn = ops.paged_attention(qkv, pool.keys[index], pool.values[index], ctx.block_tables,
                                       ctx.query_start, ctx.context_lens, self.cos, self.sin,
                                       spec.num_heads, self.scale)
            x = ops.add_rms_norm(h, self.linear(attn, layer.out), layer.post_attention_norm, eps)
            down = self.linear(ops.silu_mul(self.linear(x, layer.gate_up)), layer.down)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            x = ops.add_rms_norm(h, down, following, eps)
        # x is the final norm of every row; logits only for the rows that sample
        return self.linear(x[ctx.logits_rows], self.lm_head).float()
