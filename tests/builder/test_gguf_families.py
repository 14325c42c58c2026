"""GGUF files of each family as llama.cpp writes them: tiny random Hugging Face models converted by
llama.cpp's own convert_hf_to_gguf.py (which permutes Llama's q / k rows, keeps Qwen's and
Phi-3's, and keeps Phi-3's fused qkv and gate / up tensors), built by kiln, against transformers
on the original folder."""
import json

import pytest
import torch

from kiln.builder.checkpoint import load_checkpoint
from kiln.builder.export import ExportError, export_checkpoint
from kiln.errors import CheckpointError
from tests.helpers import build_engine, forward_logits, llama_cpp_gguf, make_tiny_model

PROMPT = [1, 17, 250, 33, 99, 5, 201, 64, 300, 12, 7, 380, 45]


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """architecture -> a tiny random model with room in its vocabulary for the special tokens
    transformers' Qwen tokenizer classes add (the converter asks for them)."""
    root = tmp_path_factory.mktemp("gguf_models")
    models = {arch: make_tiny_model(root / arch, arch, vocab_size=400) for arch in ("llama", "qwen2", "qwen3", "phi3")}
    # the converter reads a Phi-3 vocabulary from tokenizer.model (SentencePiece) unless the
    # tokenizer is GPT-2's byte-level BPE, as Phi-4 ships it
    config = json.loads((models["phi3"] / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (models["phi3"] / "tokenizer_config.json").write_text(json.dumps(config))
    return models


def assert_matches_transformers(folder, llm, prompt=PROMPT, greedy_tokens=16):
    """The engine's float32 logits within 1e-4 of transformers' on the original folder at every
    position of `prompt`, and (greedy_tokens > 0) the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    assert (forward_logits(llm.engine, prompt) - want).abs().max().item() < 1e-4
    if greedy_tokens:
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert llm.generate(prompt, max_tokens=greedy_tokens, ignore_eos=True).token_ids == greedy


def rewrite_gguf(source, out, arch="llama", drop=(), metadata=None, tensor=None, extra_tensors=None):
    """`source` rewritten to `out` with gguf's writer: its metadata but the keys in `drop` (then
    metadata(writer) adds any), each tensor as tensor(t) gives it ((data, type); default: as it
    is), then extra_tensors (name -> float32 array)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", *drop):
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    if metadata:
        metadata(writer)
    for t in reader.tensors:
        data, qtype = tensor(t) if tensor else (t.data, t.tensor_type)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_a_gguf_from_llama_cpps_converter_matches_transformers(arch, gguf_models, tmp_path, llm_for):
    """(The tiny Llama has Llama 3 rope scaling, which the converter stores as rope_freqs.weight.)"""
    gguf_file = llama_cpp_gguf(gguf_models[arch], tmp_path / f"{arch}.gguf")
    spec = load_checkpoint(gguf_file).spec
    assert spec.architecture == arch
    assert (spec.qkv_bias, spec.head_norms) == (arch == "qwen2", arch == "qwen3")
    engine_dir = build_engine(tmp_path / "engine", gguf_file, "float32")
    if arch == "llama":  # frequencies TensorRT-LLM's checkpoint cannot state
        assert spec.rope_freq_factors is not None
        with pytest.raises(ExportError, match="rope_freqs"):
            export_checkpoint(engine_dir, tmp_path / "trtllm")
    assert_matches_transformers(gguf_models[arch], llm_for(engine_dir))


# (what to change in the Llama GGUF, the error it must give): a metadata key set to a value, or an
# extra tensor by name
REFUSED = [
    (("general.architecture", "gemma2"), "GGUF architecture 'gemma2' is not supported"),
    (("llama.final_logit_softcapping", 30.0), "soft-capped logits"),
    (("llama.rope.scaling.type", "yarn"), "rope scaling 'yarn' is not supported"),
    (("llama.rope.dimension_count", 8), "partial rotary is supported on phi3 only"),
    (("tensor", "rope_factors_long.weight"), r"has no place for: rope_factors_long.weight"),  # (Phi-3 has them)
    (("tensor", "blk.0.attn_output.bias"), r"has no place for: blk.0.attn_output.bias"),
    (("tensor", "blk.1.attn_q.bias"), r"has no place for: layers.1.attention.q.bias"),  # (Qwen2 has them)
]


@pytest.mark.parametrize("change,message", REFUSED)
def test_gguf_files_kiln_cannot_read_are_refused_with_what_they_hold(gguf_models, tmp_path, change, message):
    import numpy as np

    key, value = change

    def metadata(writer):
        if key == "llama.rope.dimension_count":
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif key not in ("general.architecture", "tensor"):
            writer.add_string(key, value)

    changed = rewrite_gguf(llama_cpp_gguf(gguf_models["llama"], tmp_path / "llama.gguf"), tmp_path / "changed.gguf",
                           arch=value if key == "general.architecture" else "llama", drop=(key,), metadata=metadata,
                           extra_tensors={value: np.ones(8, dtype=np.float32)} if key == "tensor" else None)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(changed)


TEXTS = ["The quick brown fox.", "  two leading spaces,  and  doubled  ones", "line one\nline two\n\n\tindented",
         "digits 1234567 and 3.14159", "unicode: café, naïve, 東京, emoji 🙂 (byte fallback)", "def f(x):\n    return x",
         " ", "a"]


def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path, llm_for):
    """A GGUF whose vocabulary is SentencePiece BPE (tokenizer.ggml.model "llama", as Llama 2,
    Mistral, Phi-3-mini and Gemma ship theirs), written by llama.cpp's converter from a real
    tokenizer.model: kiln's tokenizer gives sentencepiece's own ids and text back, for prose, code,
    runs of spaces, digits and characters outside the vocabulary (byte fallback); BOS is added as
    llama.cpp adds it; streamed text comes out as sentencepiece decodes it; the engine builds."""
    import sentencepiece
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    from tests.helpers import make_sentencepiece

    folder = make_tiny_model(tmp_path / "llama-spm", "llama", vocab_size=600)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    make_sentencepiece(folder / "tokenizer.model", 600)
    gguf_file = llama_cpp_gguf(folder, tmp_path / "spm.gguf")
    checkpoint = load_checkpoint(gguf_file)
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_files["tokenizer.json"])
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    texts = TEXTS + [text[:400] for text in list(topics.values())[300:320]]  # not the training text
    for text in texts:
        ids = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert tokenizer.decode(ids) == sp.decode(ids), text
    assert any(sp.id_to_piece(i).startswith("<0x") for text in TEXTS for i in sp.encode(text))  # bytes were used
    assert tokenizer.encode("hello", add_special_tokens=True).ids == [1] + sp.encode("hello")
    # streamed text: token by token after a prompt, as the engine emits it, by decoding and by bytes
    from kiln.runtime.detokenizer import IncrementalDetokenizer, TokenBytes

    prompt, new = sp.encode("Hello"), sp.encode(TEXTS[4] + "\n" + TEXTS[2])
    want = sp.decode(prompt + new)[len(sp.decode(prompt)):]
    token_bytes = TokenBytes.of(tokenizer)
    assert token_bytes is not None and token_bytes.bytes_of(new).decode() == " " + sp.decode(new)
    stream = IncrementalDetokenizer(tokenizer, prompt)
    chunks = [stream.add([token], final=i == len(new) - 1) for i, token in enumerate(new)]
    assert "".join(chunk[2] for chunk in chunks if chunk) == want
    llm = llm_for(build_engine(tmp_path / "engine", gguf_file, "float32"))
    assert len(llm.generate("The quick brown", max_tokens=12, ignore_eos=True).token_ids) == 12


def test_a_gemma3_gguf_with_its_sentencepiece_vocabulary_matches_transformers(tmp_path, llm_for):
    """Gemma 3 as llama.cpp writes it (norms with Gemma's 1 added, every 6th layer global, a
    SentencePiece vocabulary without the space prefix): transformers' logits at every position on
    a prompt longer than the window, its greedy tokens, and sentencepiece's own token ids."""
    import sentencepiece
    from tokenizers import Tokenizer

    from tests.helpers import make_sentencepiece

    # six layers: llama.cpp's pattern makes the last one global; its query scale is head_dim^-0.5
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", vocab_size=600, num_hidden_layers=6,
                             layer_types=None, rope_parameters=None, query_pre_attn_scalar=32)
    make_sentencepiece(folder / "tokenizer.model", 600, space_prefix=False)
    gguf_file = llama_cpp_gguf(folder, tmp_path / "gemma3.gguf")
    checkpoint = load_checkpoint(gguf_file)
    spec = checkpoint.spec
    assert (spec.architecture, spec.full_attention_layers, spec.sliding_window) == ("gemma3", (5,), 6)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_files["tokenizer.json"])
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False).ids == sp.encode(text), text
        assert tokenizer.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    assert_matches_transformers(folder, llm_for(build_engine(tmp_path / "engine", gguf_file, "float32")))


@pytest.mark.parametrize("max_seq_len, prompt", [(32, PROMPT), (512, (PROMPT * 4)[:44])], ids=["short", "long"])
def test_a_phi3_gguf_with_longrope_and_partial_rotary_matches_transformers(max_seq_len, prompt, gguf_models,
                                                                            tmp_path, llm_for):
    """Phi-3.5 / Phi-4-mini as llama.cpp writes them: LongRoPE's divisors as rope_factors_long /
    rope_factors_short tensors and its factor in the metadata, rotary embedding on 3/4 of each head
    (rope.dimension_count); the short divisors within the original context, the long beyond."""
    g = torch.Generator().manual_seed(13)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32, "short_factor": (1 + torch.rand(6, generator=g)).tolist(),
            "long_factor": (1 + 4 * torch.rand(6, generator=g)).tolist()}
    folder = make_tiny_model(tmp_path / "phi3", "phi3", vocab_size=400, rope_parameters=rope,
                             original_max_position_embeddings=32)
    (folder / "tokenizer_config.json").write_text((gguf_models["phi3"] / "tokenizer_config.json").read_text())
    gguf_file = llama_cpp_gguf(folder, tmp_path / "phi3.gguf")
    spec = load_checkpoint(gguf_file).spec
    assert spec.rotary_dim == 12 and spec.rope_longrope.original_max_position_embeddings == 32
    llm = llm_for(build_engine(tmp_path / "engine", gguf_file, "float32", max_input_len=max_seq_len // 2,
                               max_seq_len=max_seq_len))
    assert_matches_transformers(folder, llm, prompt, greedy_tokens=0)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_a_mixture_of_experts_gguf_matches_transformers(arch, tmp_path, llm_for):
    """Mixtral (llama.cpp's `llama` with experts), Qwen3-MoE (`qwen3moe`; its Hub models
    renormalize the top-k weights, as llama.cpp does) and OLMoE (`olmoe`: q / k norms over all
    heads, top-k not renormalized) and Qwen2-MoE (`qwen2moe`: a gated shared expert as the *_shexp
    tensors) as the converter writes them: the router as ffn_gate_inp, each projection of all
    experts stacked in one tensor."""
    folder = make_tiny_model(tmp_path / arch, arch, vocab_size=400,
                             **({"norm_topk_prob": True} if arch == "qwen3_moe" else {}))
    gguf_file = llama_cpp_gguf(folder, tmp_path / f"{arch}.gguf")
    spec = load_checkpoint(gguf_file).spec
    assert (spec.architecture, spec.experts_per_token, spec.normalize_expert_weights) == (
        arch, 2, arch not in ("olmoe", "qwen2_moe"))
    assert spec.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)
    assert spec.head_norms_span == ("projection" if arch == "olmoe" else "head")
    assert_matches_transformers(folder, llm_for(build_engine(tmp_path / "engine", gguf_file, "float32")))


def kquant_bytes(rows: int, cols: int, qtype, g: torch.Generator):
    """Random valid blocks of a k-quant type (Q4_K, Q6_K: 256 values a block), as uint8
    [rows, bytes a row]: random quants and sub-block scales, small positive fp16 super-block
    scales (gguf's writer cannot quantize to k-quants; its reader dequantizes them)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rows * cols // block
    raw = torch.randint(0, 256, (blocks, size), generator=g, dtype=torch.uint8).numpy()
    scale = (np.abs(np.asarray(torch.randn(blocks, 2, generator=g))) * 0.002 + 0.0005).astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d and dmin lead the block
        raw[:, 0:4] = scale.view(np.uint8).reshape(blocks, 4)
    else:  # Q6_K: d ends it
        raw[:, size - 2:] = scale[:, :1].view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, cols // block * size)


def test_a_k_quant_gguf_is_read_as_ggufs_dequantizer_reads_it(gguf_models, tmp_path, llm_for):
    """A GGUF whose linears are k-quants (Q4_K, Q6_K; 256-value blocks) and Q5_0, written with
    gguf's writer: kiln's tensors are gguf's dequantized values (q / k rows un-permuted as
    llama.cpp's converter permuted them), and the engine builds from it and generates; then
    kiln's int4_awq quantizes those values in turn."""
    import gguf
    import numpy as np

    folder = make_tiny_model(tmp_path / "llama256", "llama", vocab_size=400, hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(17)
    kinds = [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q5_0]
    written = {}

    def requantized(t):  # a layer's linears in turn as Q4_K, Q6_K and Q5_0; the rest as they are
        data = np.asarray(t.data)
        if data.ndim != 2 or not t.name.startswith("blk."):
            return data, t.tensor_type
        qtype = kinds[len(written) % 3]
        raw = (gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)
               if qtype == gguf.GGMLQuantizationType.Q5_0 else kquant_bytes(*data.shape, qtype, g))
        written[t.name] = (qtype, gguf.quants.dequantize(raw, qtype))
        return raw, qtype

    out = rewrite_gguf(llama_cpp_gguf(folder, tmp_path / "f32.gguf"), tmp_path / "kquant.gguf", tensor=requantized)
    assert {q for q, _ in written.values()} == set(kinds)
    tensors = load_checkpoint(out).tensors
    heads = {"attn_q": 4, "attn_k": 2}
    for name, (_, values) in written.items():
        layer, kind = name.split(".")[1], name.split(".")[2]
        canonical = {"attn_q": "attention.q.weight", "attn_k": "attention.k.weight", "attn_v": "attention.v.weight",
                     "attn_output": "attention.o.weight", "ffn_gate": "mlp.gate.weight", "ffn_up": "mlp.up.weight",
                     "ffn_down": "mlp.down.weight"}[kind]
        want = torch.from_numpy(np.array(values, dtype=np.float32))
        if kind in heads:  # llama.cpp's rotary-pair order, as kiln undoes it
            want = want.reshape(heads[kind], -1, 2, want.shape[1]).swapaxes(1, 2).reshape(want.shape)
        assert torch.equal(tensors[f"layers.{layer}.{canonical}"], want), name
    llm = llm_for(build_engine(tmp_path / "engine", out, "bfloat16", quantization={
        "algo": "int4_awq", "calibration": {"samples": 4, "seq_len": 64}, "accuracy": {"tokens": 256, "window": 128},
        "accuracy_gate": None}))
    assert len(llm.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids) == 8
