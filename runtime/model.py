"""kiln's decoder model: one definition for calibration, tests and serving.

The Llama family, and the differences of the other families as declared options of the same
model (ModelSpec): Qwen3's head norms (OLMoE's over all heads); Gemma 3's output norms, GeGLU,
scaled embeddings, query scale and interleaved sliding-window / global layers with their own RoPE
bases; Mixture-of-Experts layers (Mixtral, Qwen3-MoE, OLMoE), with a gated shared expert
(Qwen2-MoE). Linear layers are runtime.linear objects (dense, or quantized with kiln's kernels);
RMSNorm, the gated activations and attention (with its KV-cache write) are the plugin ops.
Weights arrive already packed by the builder (QKV fused, gate/up fused; Gemma's (1 + w) norms
stored as their multipliers)."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln import constants as names
from kiln.plugins import ops
from kiln.runtime.key_rotation import key_hadamard
from kiln.runtime.kv_layout import KVLayout
from kiln.runtime.linear import SKINNY_ROWS, DenseLinear, Tactic, load_linear
from kiln.runtime.rope import cos_sin_tables
from kiln.runtime.spec import ModelSpec

LINEARS = ("qkv", "out", "gate_up", "down")  # Layer fields that are linear layers
KV_DTYPES = {names.KV_CACHE_INT8: torch.int8, names.KV_CACHE_FP8: torch.float8_e4m3fn}  # else the model dtype
EXPERT_LINEARS = ("gate_up", "down")  # Expert fields that are linear layers


def expert_key(expert: int, linear: str) -> str:
    """A layer's key for an expert's linear (one of EXPERT_LINEARS), beside LINEARS' names."""
    return f"experts.{expert}.{linear}"


@dataclass
class Expert:
    """One expert of a Mixture-of-Experts layer: a gated MLP (runtime.linear objects)."""

    gate_up: object
    down: object


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: object  # runtime.linear objects: callables x -> x @ W.T (+ bias)
    out: object
    post_attention_norm: torch.Tensor
    gate_up: object  # the dense MLP (in a Mixture-of-Experts layer: its shared expert, or None)
    down: object
    kv_scales: torch.Tensor | None = None  # [2, kv_size] for an int8 / FP8 KV cache
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's RMSNorm over each query head (OLMoE: [q_size], all heads)
    k_norm: torch.Tensor | None = None  # ... and over each key head ([kv_size])
    attn_out_norm: torch.Tensor | None = None  # Gemma: RMSNorm of the attention's output before the residual add
    mlp_out_norm: torch.Tensor | None = None  # ... and of the MLP's
    window: int = 0  # sliding window (0: none)
    local_rope: bool = False  # rotary tables of its own (Gemma 3's sliding-window layers)
    router: torch.Tensor | None = None  # Mixture-of-Experts: [experts, hidden]
    experts: list[Expert] | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden]: the shared expert's output times sigmoid(x @ it.T)
    expert_plan: tuple | None = None  # ops.expert_plan of the experts and the activation's code, made on first use

    def linears(self) -> dict[str, object]:
        """The layer's linear layers by key: LINEARS' names it has (a Mixture-of-Experts layer: qkv
        and out, and gate_up / down where it has a shared expert), then each expert's by expert_key."""
        found = {name: getattr(self, name) for name in LINEARS if getattr(self, name) is not None}
        for e, expert in enumerate(self.experts or ()):
            found.update({expert_key(e, name): getattr(expert, name) for name in EXPERT_LINEARS})
        return found

    def set_linear(self, key: str, linear) -> None:
        """Put `linear` in the place linears() names `key`."""
        if key.startswith("experts."):
            _, expert, name = key.split(".")
            setattr(self.experts[int(expert)], name, linear)
        else:
            setattr(self, key, linear)


@dataclass
class StepContext:
    """Attention metadata for one step of a packed batch (nano-vllm style): sequence s owns
    the tokens [query_start[s], query_start[s+1]) at positions context_lens[s] + 0, 1, ...;
    logits are computed only for the rows in `logits_rows`."""

    positions: torch.Tensor  # [tokens] int64
    query_start: torch.Tensor  # [seqs + 1] int32
    context_lens: torch.Tensor  # [seqs] int32
    # [groups, seqs, max_blocks] int32: a table per group of the pool's layout (KVPool.layout); a
    # pool of one group also takes [seqs, max_blocks]
    block_tables: torch.Tensor
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


def empty_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in private anonymous memory advised for 2 MB transparent huge pages
    (madvise; where the kernel has none the pages stay 4 KB). Untouched pages take no memory until
    written, as torch.empty's; ops.to_hugepages, the weights' route, copies into its memory and so
    writes every page, which kv_cache_reserve: false must not. A decode step's attention reads a
    4 KB run of keys and of values from each of many scattered blocks: a 16-sequence step's took
    1.08-1.18x less time on one thread in huge pages than in 4 KB ones (docs/benchmarks.md)."""
    nbytes = dtype.itemsize * math.prod(shape)
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer holds a reference to the region: it is unmapped when the last view goes
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class KVPool:
    """The key/value blocks: [slots, 2, num_blocks, kv_heads, block_size, head_dim], each layer
    at its slot of the layout (kv_layout). grouped=False (a private pool, e.g. one sequence's): one
    group, every layer a slot of its own, one block table. grouped=True (the executor's): layers of
    one sliding window share a table, so a window's blocks can be released as it moves. One
    allocation in huge pages, left uninitialized (attention reads only slots written before): its
    pages become resident as they are first written, unless reserve() writes them all up front."""

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 grouped: bool = False):
        self.layout = self.layout_for(spec, grouped)
        shape = (self.layout.slots, 2, num_blocks, spec.num_kv_heads, block_size, spec.head_dim)
        self.storage = empty_in_huge_pages(shape, dtype)
        where = self.layout.slot_and_group()
        self.keys = [self.storage[slot, 0] for slot, _ in where]
        self.values = [self.storage[slot, 1] for slot, _ in where]
        self.layer_group = [group for _, group in where]
        self.kv_layers = torch.tensor(where, dtype=torch.int64)  # ops.decode_layers' (slot, group) a layer
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * self.storage.element_size()

    def reserve(self) -> None:
        """Write every page now, so the pool is resident from the start (as it will be once
        sequences have used it) and not grown into under load."""
        self.storage.zero_()

    @staticmethod
    def layout_for(spec: ModelSpec, grouped: bool) -> KVLayout:
        return KVLayout.of([spec.window(i) for i in range(spec.num_layers)], grouped)

    @classmethod
    def bytes_per_block(cls, spec: ModelSpec, block_size: int, dtype: torch.dtype, grouped: bool = False) -> int:
        element = torch.empty(0, dtype=dtype).element_size()
        return cls.layout_for(spec, grouped).slots * 2 * block_size * spec.num_kv_heads * spec.head_dim * element

    def tables(self, block_tables: torch.Tensor) -> torch.Tensor:
        """A step's block tables as [groups, seqs, max_blocks]."""
        tables = block_tables.unsqueeze(0) if block_tables.dim() == 2 else block_tables
        if tables.dim() != 3 or tables.shape[0] != len(self.layout.groups):
            raise ValueError(f"block tables {tuple(block_tables.shape)} do not fit a pool of "
                             f"{len(self.layout.groups)} groups ({self.layout.describe()})")
        return tables


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int,
                 quantization: dict | None = None):
        """quantization: engine.json's `quantization` (how quantized linears are stored)."""
        self.spec = spec
        self.dtype = weights[names.EMBED].dtype
        self.embed = weights[names.EMBED]
        self.final_norm = weights[names.FINAL_NORM]
        quant = quantization or {}
        kv_cache = quant.get("kv_cache", "none")
        if kv_cache != "none" and kv_cache not in KV_DTYPES:
            raise KeyError(f"unknown kv_cache {kv_cache!r}; expected none, {', '.join(KV_DTYPES)}")
        self.kv_dtype = KV_DTYPES.get(kv_cache, self.dtype)  # what KVPool holds
        # how the cache stores keys: 0, or the block of the Hadamard transform after RoPE
        self.key_hadamard = key_hadamard(quant.get("key_rotation", names.KEY_ROTATION_NONE), spec.head_dim)
        if quant.get("lm_head"):  # quantized output projection (the embedding table stays for lookups)
            self.lm_head = load_linear(weights, names.LM_HEAD, self.dtype,
                                       {"linear": quant["lm_head"], "group_size": quant.get("lm_head_group_size", 0)})
        else:
            self.lm_head = DenseLinear(self.embed if spec.tie_embeddings else weights[names.LM_HEAD])
        self.layers = [self._layer(weights, i, quant) for i in range(spec.num_layers)]
        self.cos, self.sin = cos_sin_tables(spec, max_positions, self.dtype)
        self.local_cos, self.local_sin = (cos_sin_tables(spec, max_positions, self.dtype, local=True)
                                          if spec.local_rope_theta is not None else (self.cos, self.sin))
        self.scale = spec.scale
        self.activation = ops.gelu_tanh_mul if spec.activation == "gelu_tanh" else ops.silu_mul
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the model dtype as HF rounds it
        self.embed_scale = (torch.tensor(spec.embed_scale, dtype=torch.float32).to(self.dtype)
                            if spec.embed_scale is not None else None)
        # steps run every layer in one plugin call (decode_layers, Mixture-of-Experts layers' routing
        # included) up to fused_rows; the Python loop runs a few rows' experts in one (moe_mlp)
        self.fused_decode = True
        self.fused_experts = True
        self.fused_rows = self.fusable_rows()  # up to how many rows the fused calls run
        self._plan = None  # built on first use, from the layers as they are then

    def linears(self) -> list:
        """Every linear: each layer's (experts' included), then the output projection."""
        return [linear for layer in self.layers for linear in layer.linears().values()] + [self.lm_head]

    def apply_tactics(self, tactics: dict[str, Tactic]) -> int:
        """Each linear takes the tactic of its tactic_key (those without one, and those with one
        route, Routed.candidates, keep their kind's default route); returns how many took one."""
        taken = 0
        for linear in self.linears():
            tactic = tactics.get(linear.tactic_key())
            if tactic is not None and len(linear.candidates()) > 1:
                linear.tactic, taken = tactic, taken + 1
        self.fused_rows = self.fusable_rows()
        return taken

    def make_batch_invariant(self) -> None:
        """Every linear takes the route it takes for one row at every row count (kiln's kernel,
        except float32 dense linears: PyTorch's GEMM), over any tactic. A row's result then does
        not depend on the other rows of its step: kiln's kernels compute each row alone, in an
        order that does not depend on the batch or on the threads (tests/plugins), and float32
        GEMMs give the same greedy tokens (tests/runtime/test_batching.py)."""
        for linear in self.linears():
            linear.tactic = Tactic([1], [names.TACTIC_KILN if linear.uses_kernel(1) else names.TACTIC_TORCH])
        self.fused_rows = self.fusable_rows()

    def fusable_rows(self) -> float:
        """Up to how many rows a step runs in one plugin call (decode_layers; moe_mlp for a Mixture
        of Experts): the most rows up to which every layer's linear routes as those calls run it
        (kiln's kernel; float32 dense: PyTorch's GEMM in both), so a fused step has the same
        numbers as the loop. inf: every step the engine allows, prefill chunks beside decodes
        included (what the loop costs in the interpreter, ~2 ms a step of SmolLM2, is then gone
        at every size). Mixture-of-Experts models stop at SKINNY_ROWS: their routing's torch ops
        (the router's GEMM, top-k, gathers) would run on one thread inside the call's team."""
        linears = [linear for layer in self.layers for linear in layer.linears().values()]
        rows = min((linear.fused_through() for linear in linears), default=float("inf"))
        if any(layer.experts for layer in self.layers):
            rows = min(rows, SKINNY_ROWS)
        return rows

    def decode_plan(self) -> tuple[list, list[int], list[float]]:
        """The layers as ops.decode_layers takes them (ops.decode_plan)."""
        return ops.decode_plan([self._plan_record(index, layer) for index, layer in enumerate(self.layers)])

    def _plan_record(self, index: int, layer: Layer) -> dict:
        record = {**{name: getattr(layer, name).plan() for name in LINEARS if getattr(layer, name) is not None},
                  "post_attention_norm": layer.post_attention_norm, "next_norm": self.next_norm(index),
                  "kv_scales": layer.kv_scales}
        if layer.q_norm is not None:
            record.update(q_norm=layer.q_norm, k_norm=layer.k_norm)
        if layer.attn_out_norm is not None:
            record.update(attn_out_norm=layer.attn_out_norm, mlp_out_norm=layer.mlp_out_norm)
        if layer.local_rope:
            record.update(cos=self.local_cos, sin=self.local_sin)
        if layer.experts:
            spec = self.spec
            if layer.shared_gate is not None:
                record.update(shared_gate=layer.shared_gate)
            record.update(router=layer.router, experts=len(layer.experts), top_k=spec.experts_per_token,
                          normalize_experts=int(spec.normalize_expert_weights),
                          round_expert_weights=int(spec.round_expert_weights),
                          expert_linears=[(e.gate_up.plan(), e.down.plan()) for e in layer.experts])
        return record | {"window": layer.window, "activation": self.spec.activation}

    def next_norm(self, index: int) -> torch.Tensor:
        """The norm after layer `index`: the next layer's input norm, or the final norm."""
        return self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm

    def _layer(self, weights: dict[str, torch.Tensor], i: int, quant: dict) -> Layer:
        def get(name: str) -> torch.Tensor:
            return weights[names.layer_tensor(i, name)]

        def linear(name: str, bias: torch.Tensor | None = None):
            return load_linear(weights, names.layer_tensor(i, name), self.dtype, quant, bias)

        kv_scales = None
        if self.kv_dtype != self.dtype:
            kv_scales = weights.get(names.layer_tensor(i, names.ATTN_KV_SCALES))
            if kv_scales is None:
                raise KeyError(f"a {quant['kv_cache']} KV cache needs {names.layer_tensor(i, names.ATTN_KV_SCALES)}")
            kv_scales = kv_scales.float().contiguous()

        moe = self.spec.num_experts > 0
        dense_mlp = not moe or self.spec.shared_expert_intermediate_size > 0  # (a shared expert is one)
        return Layer(
            input_norm=get(names.INPUT_NORM),
            qkv=linear(names.ATTN_QKV, weights.get(names.layer_tensor(i, names.ATTN_QKV_BIAS))),
            out=linear(names.ATTN_OUT),
            post_attention_norm=get(names.POST_ATTENTION_NORM),
            gate_up=linear(names.MLP_GATE_UP) if dense_mlp else None,
            down=linear(names.MLP_DOWN) if dense_mlp else None,
            router=get(names.MLP_ROUTER) if moe else None,
            shared_gate=get(names.MLP_SHARED_GATE) if moe and self.spec.shared_expert_gated else None,
            experts=[Expert(linear(names.expert_tensor(e, "gate_up.weight")), linear(names.expert_tensor(e, "down.weight")))
                     for e in range(self.spec.num_experts)] if moe else None,
            kv_scales=kv_scales,
            q_norm=get(names.ATTN_Q_NORM) if self.spec.head_norms else None,
            k_norm=get(names.ATTN_K_NORM) if self.spec.head_norms else None,
            attn_out_norm=get(names.ATTN_OUT_NORM) if self.spec.output_norms else None,
            mlp_out_norm=get(names.MLP_OUT_NORM) if self.spec.output_norms else None,
            window=self.spec.window(i),
            local_rope=self.spec.local_rope_theta is not None and self.spec.window(i) > 0,
        )

    def norm_heads(self, qkv: torch.Tensor, layer: Layer) -> torch.Tensor:
        """qkv with the queries and keys RMS-normalized (before RoPE): each head (Qwen3, Gemma 3),
        or each row's whole query and key projections (OLMoE), as the norms' lengths say."""
        spec = self.spec
        rows, q, kv = qkv.shape[0], spec.q_size, spec.kv_size
        queries = ops.rms_norm(qkv[:, :q].reshape(-1, layer.q_norm.shape[0]), layer.q_norm, spec.norm_eps)
        keys = ops.rms_norm(qkv[:, q:q + kv].reshape(-1, layer.k_norm.shape[0]), layer.k_norm, spec.norm_eps)
        return torch.cat([queries.view(rows, q), keys.view(rows, kv), qkv[:, q + kv:]], dim=1)

    def mixture(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        """A Mixture-of-Experts MLP (as transformers' Mixtral / Qwen3-MoE blocks): the router's
        softmax in float32, each token's top experts_per_token weights (rescaled to sum to 1 where
        the family does), then each chosen expert once over the rows routed to it, in expert
        order, its output times the row's weight added into the result. Only the chosen experts'
        weights are read. A shared expert (Qwen2-MoE: the layer's gate_up / down) runs on every
        row, its output (times sigmoid(x @ shared_gate.T) where gated) added last. A few rows
        (decode) run it in one plugin call, bit for bit."""
        spec = self.spec
        shared = layer.gate_up is not None
        if self.fused_experts and x.shape[0] <= self.fused_rows:  # the same, in one plugin call
            if layer.expert_plan is None:  # (the plan's lists, then the activation's code)
                pairs = [(e.gate_up, e.down) for e in layer.experts] + ([(layer.gate_up, layer.down)] if shared else [])
                layer.expert_plan = (*ops.expert_plan([(gate_up.plan(), down.plan()) for gate_up, down in pairs]),
                                     ops.activation_codes()[spec.activation])
            *plan, activation = layer.expert_plan
            return ops.moe_mlp(x, layer.router, *plan, spec.experts_per_token, spec.normalize_expert_weights,
                               spec.round_expert_weights, activation, layer.shared_gate)
        probs = F.linear(x, layer.router).float().softmax(dim=-1)
        weights, chosen = probs.topk(spec.experts_per_token, dim=-1)
        if spec.normalize_expert_weights:
            weights /= weights.sum(dim=-1, keepdim=True)
        if spec.round_expert_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            expert = layer.experts[e]
            y = expert.down(self.activation(expert.gate_up(x[rows])))
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
        if shared:
            y = layer.down(self.activation(layer.gate_up(x)))
            out = out + (y if layer.shared_gate is None else torch.sigmoid(F.linear(x, layer.shared_gate)) * y)
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, ctx: StepContext, pool: KVPool) -> torch.Tensor:
        """Run a packed batch of tokens (1-D); float32 logits [len(ctx.logits_rows), vocab].

        Per layer: 4 GEMMs and 3 plugin ops: the residual add fused into RMSNorm,
        rotary embedding + KV write + attention in one, SwiGLU (or GeGLU) in one; Gemma's output
        norms add two. Steps of up to
        fused_rows tokens (decodes and prefill chunks alike) run the same loop inside the plugin
        library (decode_layers), bit for bit the same numbers without the interpreter between the
        ~240 kernel calls."""
        spec = self.spec
        eps = spec.norm_eps
        h = F.embedding(tokens, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        tables = pool.tables(ctx.block_tables)
        if self.fused_decode and tokens.shape[0] <= self.fused_rows:  # the same kernels, without Python between
            if self._plan is None:
                self._plan = self.decode_plan()
            x = ops.decode_layers(h, x, *self._plan, pool.storage, pool.kv_layers, tables, ctx.query_start,
                                  ctx.context_lens, self.cos, self.sin, spec.num_heads, self.scale, eps,
                                  self.key_hadamard)
            return self.lm_head(x[ctx.logits_rows]).float()
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if layer.q_norm is not None:
                qkv = self.norm_heads(qkv, layer)
            cos, sin = (self.local_cos, self.local_sin) if layer.local_rope else (self.cos, self.sin)
            attn = ops.paged_attention(qkv, pool.keys[index], pool.values[index], tables[pool.layer_group[index]],
                                       ctx.query_start, ctx.context_lens, cos, sin, spec.num_heads, self.scale,
                                       layer.kv_scales, self.key_hadamard, layer.window)
            attn = layer.out(attn)
            if layer.attn_out_norm is not None:
                attn = ops.rms_norm(attn, layer.attn_out_norm, eps)
            x = ops.add_rms_norm(h, attn, layer.post_attention_norm, eps)
            down = self.mixture(x, layer) if layer.experts else layer.down(self.activation(layer.gate_up(x)))
            if layer.mlp_out_norm is not None:
                down = ops.rms_norm(down, layer.mlp_out_norm, eps)
            x = ops.add_rms_norm(h, down, self.next_norm(index), eps)
        # x is the final norm of every row; logits only for the rows that sample
        return self.lm_head(x[ctx.logits_rows]).float()
