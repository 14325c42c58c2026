"""Compile passes: fuse QKV and gate/up, cast to the engine dtype, and store tensors under the
engine's names (kiln.constants) in the engine's storage formats (plugins/formats.py). The
runtime re-lays int4 / int8 weights out at load into the tiled layouts of the kernels the host
runs (runtime/linear.py), so one engine serves every x86-64 CPU."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kiln import constants as names
from kiln.builder.checkpoint import PACKED_PARTS, Checkpoint
from kiln.errors import CheckpointError


def pack_weights(
    checkpoint: Checkpoint, dtype: torch.dtype, progress: Callable[[], None] = lambda: None
) -> dict[str, torch.Tensor]:
    """Canonical float32 tensors -> packed engine tensors. Consumes checkpoint.tensors."""
    src = checkpoint.tensors
    spec = checkpoint.spec

    def take(name: str) -> torch.Tensor:
        return src.pop(name)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous()

    packed = {names.EMBED: cast(take(names.CKPT_EMBED)), names.FINAL_NORM: cast(take(names.CKPT_FINAL_NORM))}
    if not spec.tie_embeddings:
        packed[names.LM_HEAD] = cast(take(names.CKPT_LM_HEAD))
    for i in range(spec.num_layers):
        def layer(n: str) -> torch.Tensor:
            return take(names.layer_tensor(i, n))

        out = {names.INPUT_NORM: layer("input_norm.weight"),
               names.POST_ATTENTION_NORM: layer("post_attention_norm.weight")}
        for fused, parts in PACKED_PARTS.items():
            if names.layer_tensor(i, parts[0]) in src:  # else already quantized (checkpoint.prequantized)
                out[fused] = torch.cat([layer(part) for part in parts])
        if spec.num_experts:  # the router as it is; each expert's gate and up fused as a dense MLP's
            out[names.MLP_ROUTER] = layer(names.CKPT_ROUTER)
            if spec.shared_expert_gated:  # (the shared expert itself is packed as the dense MLP above)
                out[names.MLP_SHARED_GATE] = layer(names.CKPT_SHARED_GATE)
            for e in range(spec.num_experts):
                gate, up, down = (layer(names.expert_tensor(e, n)) for n in names.CKPT_EXPERT)
                out[names.expert_tensor(e, "gate_up.weight")] = torch.cat([gate, up])
                out[names.expert_tensor(e, "down.weight")] = down
        if spec.qkv_bias:
            out[names.ATTN_QKV_BIAS] = torch.cat(
                [layer("attention.q.bias"), layer("attention.k.bias"), layer("attention.v.bias")]
            )
        if spec.head_norms:
            for packed_name, canonical, size in zip(names.HEAD_NORMS, names.CKPT_HEAD_NORMS, spec.head_norm_sizes):
                out[packed_name] = layer(canonical)
                if out[packed_name].shape != (size,):
                    raise CheckpointError(f"{names.layer_tensor(i, canonical)} has shape {tuple(out[packed_name].shape)}; "
                                          f"norms over each {spec.head_norms_span} of this model take [{size}]")
        if spec.output_norms:
            for packed_name, canonical in zip(names.OUTPUT_NORMS, names.CKPT_OUTPUT_NORMS):
                out[packed_name] = layer(canonical)
        for name, tensor in out.items():
            packed[names.layer_tensor(i, name)] = cast(tensor)
        progress()
    packed.update(checkpoint.prequantized)  # kept as they are (quantized; scales in float32)
    return packed


def float32_model(checkpoint: Path, max_positions: int):
    """The unquantized checkpoint as a float32 kiln model, packed as a build packs it (the
    reference `kiln eval --reference` and a quantized build measure against)."""
    from kiln.builder.checkpoint import load_checkpoint
    from kiln.runtime.model import LlamaModel

    loaded = load_checkpoint(checkpoint)
    return LlamaModel(loaded.spec, pack_weights(loaded, torch.float32), max_positions)
