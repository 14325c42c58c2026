"""Every name that is part of a wire or file format, in one place.

Engine directory files, engine tensor names, Triton model and tensor names. Changing one of
these changes a format: bump ENGINE_FORMAT_VERSION for engine names."""

# --- engine directory -------------------------------------------------------------------
ENGINE_FORMAT_VERSION = 5  # 2: paged attention; 3: fused rope/norm/SwiGLU; 4: GEMV; 5: AVX512-BF16 kernels
ENGINE_JSON = "engine.json"
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "MANIFEST.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
PLUGINS_DIR = "plugins"
RESOLVED_CONFIG_FILE = "build_config.yaml"

# --- engine tensors (packed layout, as the runtime reads them) ---------------------------
EMBED = "embed.weight"
FINAL_NORM = "final_norm.weight"
LM_HEAD = "lm_head.weight"  # absent when embeddings are tied
INPUT_NORM = "input_norm.weight"
POST_ATTENTION_NORM = "post_attention_norm.weight"
ATTN_QKV = "attention.qkv.weight"  # rows: q heads, then k heads, then v heads
ATTN_QKV_BIAS = "attention.qkv.bias"  # Qwen2 only
ATTN_OUT = "attention.out.weight"
MLP_GATE_UP = "mlp.gate_up.weight"  # rows: gate, then up
MLP_DOWN = "mlp.down.weight"


def layer_tensor(index: int, name: str) -> str:
    return f"layers.{index}.{name}"


# --- Triton model repository ------------------------------------------------------------
MODEL_PREPROCESSING = "preprocessing"
MODEL_ENGINE = "kiln"
MODEL_POSTPROCESSING = "postprocessing"
MODEL_ENSEMBLE = "ensemble"
ENGINE_DIR_PARAMETER = "engine_dir"  # config.pbtxt parameter; relative to the repository
TOKENIZER_DIR_PARAMETER = "tokenizer_dir"

# ensemble inputs / outputs (TensorRT-LLM's inflight_batcher_llm names)
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
END_ID = "end_id"
TEXT_OUTPUT = "text_output"

# between the composing models
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
REQUEST_OUTPUT_LEN = "request_output_len"
STREAMING = "streaming"
RUNTIME_TOP_K = "runtime_top_k"
RUNTIME_TOP_P = "runtime_top_p"
RANDOM_SEED = "random_seed"
OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
PREFIX_IDS = "prefix_ids"  # tokens before output_ids that decoding needs for context
TOKENS_BATCH = "TOKENS_BATCH"
PREFIX_BATCH = "PREFIX_BATCH"

# --- canonical (unfused) checkpoint tensors: what every checkpoint reader produces ---------
CKPT_EMBED = "embed.weight"
CKPT_FINAL_NORM = "final_norm.weight"
CKPT_LM_HEAD = "lm_head.weight"
CKPT_LAYER_TENSORS = (
    "input_norm.weight",
    "post_attention_norm.weight",
    "attention.q.weight",
    "attention.k.weight",
    "attention.v.weight",
    "attention.o.weight",
    "mlp.gate.weight",
    "mlp.up.weight",
    "mlp.down.weight",
)
CKPT_QKV_BIASES = ("attention.q.bias", "attention.k.bias", "attention.v.bias")

# engine model custom metrics (Triton metrics endpoint, Prometheus text format)
METRIC_KV_BLOCKS = "kiln_kv_cache_blocks"
METRIC_REQUESTS = "kiln_requests"
METRIC_PREEMPTIONS = "kiln_preemptions"
METRIC_PREFIX_HIT_RATE = "kiln_prefix_hit_rate"
