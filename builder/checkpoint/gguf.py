"""GGUF files (llama (Mixtral: llama with experts), qwen2, qwen3, qwen3moe, qwen2moe, olmoe, phi3 and gemma3
architectures, as llama.cpp's convert_hf_to_gguf.py writes them): dequantized with the `gguf` package, tokenizer rebuilt for
`tokenizers` (byte-level BPE or SentencePiece BPE). Phi-3's fused attn_qkv and ffn_up (gate and
up rows) are split into the canonical tensors; Gemma 3's norms arrive as their multipliers
(the converter adds Gemma's 1 to each)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from kiln import constants as names
from kiln.builder.checkpoint import Checkpoint, refuse_unused
from kiln.errors import CheckpointError
from kiln.runtime.spec import LongRope, ModelSpec

_TOP_NAMES = {
    "token_embd.weight": names.CKPT_EMBED,
    "output_norm.weight": names.CKPT_FINAL_NORM,
    "output.weight": names.CKPT_LM_HEAD,
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "attn_norm.weight": "input_norm.weight",
    "ffn_norm.weight": "post_attention_norm.weight",
    "attn_q.weight": "attention.q.weight",
    "attn_k.weight": "attention.k.weight",
    "attn_v.weight": "attention.v.weight",
    "attn_output.weight": "attention.o.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
    "attn_q.bias": "attention.q.bias",  # qwen2
    "attn_k.bias": "attention.k.bias",
    "attn_v.bias": "attention.v.bias",
    "attn_q_norm.weight": "attention.q_norm.weight",  # qwen3, gemma3
    "attn_k_norm.weight": "attention.k_norm.weight",
}
# Mixture-of-Experts (Mixtral as llama.cpp's `llama` with experts, `qwen3moe`, `olmoe`): the router, and
# each projection of every expert stacked in one [experts, out, in] tensor
_ROUTER = "ffn_gate_inp.weight"
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate.weight", "ffn_up_exps.weight": "up.weight",
                    "ffn_down_exps.weight": "down.weight"}
_GEMMA3_LAYER_NAMES = {  # Gemma 3's norms of the attention's and the MLP's outputs; ffn_norm is the MLP's input norm
    **_LAYER_NAMES,
    "post_attention_norm.weight": "attention.out_norm.weight",
    "post_ffw_norm.weight": "mlp.out_norm.weight",
}
# Gemma 3 in llama.cpp: every 6th layer attends globally, the others within the window at RoPE base
# 10000 (neither is in the file); the query scale is head_dim^-0.5, but (hidden / heads)^-0.5 on the
# 62-layer 27B model, as its query_pre_attn_scalar says
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA, GEMMA3_27B_LAYERS = 6, 10_000.0, 62
# Phi-3's fused tensors -> the canonical tensors they hold, row blocks in this order
_FUSED = {
    "attn_qkv.weight": ("attention.q.weight", "attention.k.weight", "attention.v.weight"),
    "ffn_up.weight": ("mlp.gate.weight", "mlp.up.weight"),  # phi3: gate_up_proj as it stands
}
# general.architecture -> whether llama.cpp permuted the q / k rows (its Llama converter interleaves
# the rotary pairs; its Qwen and Phi-3 converters keep Hugging Face's rotate-half order)
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "phi3": False, "gemma3": False, "qwen3moe": False,
                 "olmoe": False, "qwen2moe": False}
MOE_ARCHITECTURES = ("llama", "qwen3moe", "olmoe", "qwen2moe")  # (a `llama` GGUF with experts is a Mixtral)
# Qwen2-MoE's shared expert (the canonical dense MLP beside the experts) and its gate, [1, hidden]
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "mlp.gate.weight", "ffn_up_shexp.weight": "mlp.up.weight",
                  "ffn_down_shexp.weight": "mlp.down.weight", "ffn_gate_inp_shexp.weight": names.CKPT_SHARED_GATE}
FUSED_ARCHITECTURES = ("phi3",)
# tensors of Phi-3's long-context RoPE scaling (LongRoPE): its long and short divisors
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

# Pre-tokenizer splits per tokenizer.ggml.pre, as llama.cpp applies them before byte-level BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2: as Llama 3's, but digits one at a time
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_PRE = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")

# tokenizer.ggml.token_type values (SentencePiece's piece types, as llama.cpp's converter writes them)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _dequantized(t) -> torch.Tensor:
    """A GGUF tensor as float32, in PyTorch's dimension order (GGUF lists dimensions innermost first)."""
    import gguf

    values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return torch.from_numpy(values).reshape(tuple(int(d) for d in reversed(t.shape)))


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _sentencepiece_tokenizer(reader, source: Path, tokens: list[str], types: list[int]):
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama": Llama 1-2, Mistral, Phi-3,
    Gemma) as a `tokenizers` BPE: SentencePiece merges the adjacent pair whose joined piece scores
    highest, so every split of a normal piece into two pieces of the vocabulary is a merge, ranked
    by the joined piece's score (ties by id), as transformers derives them from a tokenizer.model;
    characters outside the vocabulary fall back to the <0xNN> byte pieces. Spaces become "▁", with
    one prepended to each stretch of text where the file says so (add_space_prefix, as llama.cpp
    prepends it to the text after each special token)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind != TOKEN_TYPE_NORMAL or len(piece) < 2:
            continue
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += [(left, right, float(score)) for left, right in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda merge: merge[2], reverse=True)  # stable: ties keep their order
    unknown = next((tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_UNKNOWN), None)
    tokenizer = Tokenizer(models.BPE(vocab, [(left, right) for left, right, _ in merges], unk_token=unknown,
                                     fuse_unk=True, byte_fallback=True))
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def _tokenizer_json(reader, source: Path) -> tuple[str, str]:
    from tokenizers import AddedToken, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{source}: tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' "
                              "and SentencePiece BPE 'llama' are)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if kind == "llama":
        tokenizer = _sentencepiece_tokenizer(reader, source, tokens, types)
        special_types = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    else:
        tokenizer = _byte_level_tokenizer(reader, source, tokens)
        special_types = (TOKEN_TYPE_CONTROL,)
    special = [
        AddedToken(t, special=ty in special_types, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (*special_types, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(special)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary's prompts unless the file says otherwise
    if _field(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return tokenizer.to_str(), json.dumps(config, indent=2)


def _byte_level_tokenizer(reader, source: Path, tokens: list[str]):
    """A byte-level BPE vocabulary (tokenizer.ggml.model "gpt2") with its pre-tokenizer's splits."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in KNOWN_PRE:
        raise CheckpointError(f"{source}: pre-tokenizer {pre!r} unknown; kiln knows {KNOWN_PRE}")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, as the model's own tokenizer (and llama.cpp) split them
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _split_fused(fused: dict[tuple[int, str], torch.Tensor], spec: ModelSpec, path: Path) -> dict:
    """Phi-3's attn_qkv (q, k, v rows) and ffn_up (gate, up rows) as the canonical tensors."""
    out = {}
    for (layer, gguf_name), tensor in fused.items():
        parts = _FUSED[gguf_name]
        sizes = [spec.q_size, spec.kv_size, spec.kv_size] if len(parts) == 3 else [spec.intermediate_size] * 2
        if tensor.shape[0] != sum(sizes):
            raise CheckpointError(f"{path}: GGUF tensor blk.{layer}.{gguf_name} has {tensor.shape[0]} rows; "
                                  f"the metadata says {sum(sizes)}")
        for name, piece in zip(parts, tensor.split(sizes)):
            out[names.layer_tensor(layer, name)] = piece
    return out


def load_gguf(path: Path) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors on damaged files
        raise CheckpointError(f"cannot read GGUF file {path}: {exc} (truncated or corrupt?)") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"({', '.join(ARCHITECTURES)} are)")

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise CheckpointError(f"{path}: GGUF rope scaling {scaling!r} is not supported yet (none and linear are)")
    if _field(reader, f"{arch}.final_logit_softcapping") or _field(reader, f"{arch}.attn_logit_softcapping"):
        raise CheckpointError(f"{path}: GGUF {arch} with soft-capped logits is not supported")
    heads, kv_heads, hidden = meta("attention.head_count"), meta("attention.head_count_kv"), meta("embedding_length")
    head_dim = int(meta("attention.key_length", hidden // heads))
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim and arch != "phi3":
        raise CheckpointError(f"{path}: GGUF {arch}.rope.dimension_count {rotary} differs from the head size "
                              f"{head_dim} (rotary embedding on part of each head: partial rotary is supported on "
                              "phi3 only)")
    layer_names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[tuple[int, str], torch.Tensor] = {}
    freq_factors = None
    longrope: dict[str, tuple[float, ...]] = {}  # Phi-3's long-context RoPE divisors, by tensor name
    unknown = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3 scaling, as llama.cpp's converter stores it
            freq_factors = tuple(_dequantized(t).reshape(-1).tolist())
            continue
        if t.name in _LONGROPE_TENSORS and arch == "phi3":
            longrope[t.name] = tuple(_dequantized(t).reshape(-1).tolist())
            continue
        name = _TOP_NAMES.get(t.name)
        match = _LAYER.match(t.name)
        fused_key = None
        if match and arch in FUSED_ARCHITECTURES and match.group(2) in _FUSED:
            fused_key = (int(match.group(1)), match.group(2))
        elif match and match.group(2) in layer_names:
            name = names.layer_tensor(int(match.group(1)), layer_names[match.group(2)])
        elif match and arch in MOE_ARCHITECTURES and match.group(2) == _ROUTER:
            name = names.layer_tensor(int(match.group(1)), names.CKPT_ROUTER)
        elif match and arch == "qwen2moe" and match.group(2) in _SHARED_EXPERT:
            name = names.layer_tensor(int(match.group(1)), _SHARED_EXPERT[match.group(2)])
        elif match and arch in MOE_ARCHITECTURES and match.group(2) in _STACKED_EXPERTS:
            for e, expert in enumerate(_dequantized(t)):
                tensors[names.layer_tensor(int(match.group(1)), names.expert_tensor(
                    e, _STACKED_EXPERTS[match.group(2)]))] = expert.clone()
            continue
        if name is None and fused_key is None:
            unknown.append(t.name)
            continue
        weight = _dequantized(t)
        if fused_key is not None:
            fused[fused_key] = weight
            continue
        if name.endswith(names.CKPT_SHARED_GATE):
            weight = weight.reshape(1, -1)  # (a vector in the file)
        if ARCHITECTURES[arch] and name.endswith("attention.q.weight"):
            weight = _unpermute(weight, heads)
        elif ARCHITECTURES[arch] and name.endswith("attention.k.weight"):
            weight = _unpermute(weight, kv_heads)
        tensors[name] = weight
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    layers = int(meta("block_count"))
    linear = float(meta("rope.scaling.factor")) if scaling == "linear" else None
    options = dict(qkv_bias=arch in ("qwen2", "qwen2moe"), head_norms=arch == "qwen3", rope_linear_factor=linear,
                   rotary_dim=int(rotary) if rotary is not None and int(rotary) != head_dim else None)
    experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if experts:  # as transformers' Mixtral (renormalized top-k), Qwen3-MoE and OLMoE (the weights rounded
        # to the dtype; OLMoE's q / k norms span all heads, and its top-k is not renormalized unless stated)
        options.update(num_experts=experts, experts_per_token=int(meta("expert_used_count")),
                       expert_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", 0)
                                                    or meta("feed_forward_length")),
                       normalize_expert_weights=bool(_field(reader, f"{arch}.expert_weights_norm",
                                                                      arch not in ("olmoe", "qwen2moe"))),
                       round_expert_weights=arch in ("qwen3moe", "olmoe", "qwen2moe"),
                       head_norms=arch in ("qwen3moe", "olmoe"), head_norms_span="projection" if arch == "olmoe" else "head")
        if arch == "qwen2moe":  # its shared expert, gated
            options.update(shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")),
                           shared_expert_gated=True)
    if longrope:  # as llama.cpp runs Phi-3's LongRoPE: divisors from the tensors, the factor from the metadata
        if set(longrope) != set(_LONGROPE_TENSORS):
            raise CheckpointError(f"{path}: GGUF phi3 has {sorted(longrope)} without the other LongRoPE tensor")
        options["rope_longrope"] = LongRope(
            short_factor=longrope["rope_factors_short.weight"], long_factor=longrope["rope_factors_long.weight"],
            original_max_position_embeddings=int(meta("rope.scaling.original_context_length")),
            attention_factor=float(meta("rope.scaling.attn_factor", 1.0)))
    if arch == "gemma3":
        query = hidden / heads if layers == GEMMA3_27B_LAYERS else head_dim
        options.update(head_norms=True, output_norms=True, activation="gelu_tanh", embed_scale=float(hidden) ** 0.5,
                       query_scale=float(query) ** -0.5, local_rope_theta=GEMMA3_LOCAL_THETA,
                       full_attention_layers=tuple(i for i in range(layers) if i % GEMMA3_PATTERN == GEMMA3_PATTERN - 1))
    spec = ModelSpec(
        architecture="mixtral" if arch == "llama" and experts else {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(
            arch, arch),
        vocab_size=int(meta("vocab_size", len(tokens))),
        hidden_size=int(hidden),
        num_layers=layers,
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        intermediate_size=int(meta("feed_forward_length")),
        max_position_embeddings=int(meta("context_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 0)) or None,  # 0: none (Phi-4)
        tie_embeddings=names.CKPT_LM_HEAD not in tensors,
        rope_freq_factors=freq_factors,
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_ids=(int(eos),) if eos is not None else (),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        **options,
    )
    refuse_unused(path, spec, unknown, {name: name for name in tensors})
    tensors.update(_split_fused(fused, spec, path))
    tokenizer_json, tokenizer_config = _tokenizer_json(reader, path)
    return Checkpoint(
        spec,
        tensors,
        {names.TOKENIZER_JSON: tokenizer_json, names.TOKENIZER_CONFIG_JSON: tokenizer_config},
    )
