"""Every name that is part of a wire or file format, in one place.

Engine directory files, engine tensor names, Triton model and tensor names. Changing one of
these changes a format: bump ENGINE_FORMAT_VERSION for engine names."""

# --- engine directory -------------------------------------------------------------------
ENGINE_FORMAT_VERSION = 10  # 2: paged attention; 3: fused rope/norm/SwiGLU; 4: GEMV; 5: AVX512-BF16 kernels;
# 6: quantized linears (int8 / int4 weights, W8A8); 7: FP8 linears, input_scale, int8 / FP8 KV cache;
# 8: the KV cache's key rotation (quantization.key_rotation); 9: sliding-window attention (engines
# may hold a window shorter than max_seq_len), Gemma 3's options (spec fields, output norms),
# LongRoPE and partial rotary, Mixture-of-Experts layers (router, experts; experts' pre-scales),
# head norms over the whole projection (OLMoE: the spec's head_norms_span), shared experts
# (Qwen2-MoE: a MoE layer's mlp.gate_up / mlp.down and mlp.shared_gate). (Qwen3's head norms were
# new tensors and a new spec field that older engines simply lack: no new version.)
# 10: the KV pool's blocks head-major, [kv_heads, block_size, head_dim] (an engine's plugin library
# and the runtime's pool must agree on it).
ENGINE_JSON = "engine.json"
WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "MANIFEST.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_JSON = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the model's chat template, in tokenizer/ (else tokenizer_config.json's
# "chat_template"), as transformers saves it
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
ATTN_Q_NORM = "attention.q_norm.weight"  # Qwen3: an RMSNorm over each query head, before RoPE
ATTN_K_NORM = "attention.k_norm.weight"  # ... and over each key head
HEAD_NORMS = (ATTN_Q_NORM, ATTN_K_NORM)
ATTN_OUT_NORM = "attention.out_norm.weight"  # Gemma: an RMSNorm of the attention's output before the residual add
MLP_OUT_NORM = "mlp.out_norm.weight"  # ... and of the MLP's
OUTPUT_NORMS = (ATTN_OUT_NORM, MLP_OUT_NORM)
MLP_ROUTER = "mlp.router.weight"  # Mixture-of-Experts: [experts, hidden], the router's logits (kept unquantized)
# a Mixture-of-Experts layer's shared expert (Qwen2-MoE) is its mlp.gate_up / mlp.down, which every
# token runs, its output times sigmoid(x @ shared_gate.T) where the family gates it
MLP_SHARED_GATE = "mlp.shared_gate.weight"  # [1, hidden] (kept unquantized)


def expert_tensor(expert: int, name: str) -> str:
    """An expert's tensor within a layer: mlp.experts.{expert}.gate_up.weight (gate, up rows fused),
    mlp.experts.{expert}.down.weight, and their quantized forms."""
    return f"mlp.experts.{expert}.{name}"
ATTN_OUT = "attention.out.weight"
MLP_GATE_UP = "mlp.gate_up.weight"  # rows: gate, then up
MLP_DOWN = "mlp.down.weight"
ATTN_KV_SCALES = "attention.kv_scales"  # float32 [2, kv_heads * head_dim]: K's then V's per-channel
# scales for an int8 / FP8 KV cache (the pool holds k / scale, v / scale)
KV_CACHE_INT8 = "int8"  # engine.json quantization.kv_cache
KV_CACHE_FP8 = "fp8"
KEY_ROTATION_NONE = "none"  # engine.json quantization.key_rotation: how the KV cache's keys are stored
KEY_ROTATION_HADAMARD = "hadamard"  # after RoPE, times the Walsh-Hadamard matrix (runtime/key_rotation.py)


def layer_tensor(index: int, name: str) -> str:
    return f"layers.{index}.{name}"


# A quantized linear replaces its `.weight` with these (same prefix, e.g. layers.3.mlp.down):
QWEIGHT = "qweight"  # int8 [out, in], float8_e4m3fn [out, in], or int4 packed two per byte along `in`:
# uint8 [out, ceil(in/2)]
WEIGHT_SCALES = "scales"  # float32 [out] (per channel) or [out, groups] (int4, group-wise)
PRE_SCALE = "pre_scale"  # float32 [in]: multiplies the input first (AWQ/SmoothQuant scales that
# cannot be folded into a norm or the previous linear)
WEIGHT_SUM = "qweight_sum"  # int32 [out]: row sums of an int8 weight (the u8 x s8 VNNI offset)
INPUT_SCALE = "input_scale"  # float32 [1]: static per-tensor FP8 activation scale (x / s is E4M3)
# engine.json quantization.linear / .lm_head: how a qweight is used
LINEAR_INT8 = "int8_wo"  # int8 weights, float activations
LINEAR_INT4 = "int4"  # group-wise int4 weights, float activations
LINEAR_W4A8 = "w4a8"  # group-wise int4 weights, int8 activations per row and group
LINEAR_W8A8 = "w8a8"  # int8 weights, int8 activations per row
LINEAR_FP8 = "fp8"  # FP8 E4M3 weights (scale per channel), FP8 E4M3 activations (static per tensor)
LINEAR_W4A8_FP8 = "w4a8_fp8"  # group-wise int4 weights, FP8 E4M3 activations (static per tensor)


# engine.json "tactics": which implementation each linear shape runs at each row count, timed on the
# build host (builder/tactics.py; runtime/linear.py honours them where the kernels' level matches)
TACTICS = "tactics"
TACTIC_KILN = "kiln"  # kiln's kernel on the packed weights (row-invariant: a row's bits never depend on the others)
TACTIC_TORCH = "torch"  # the weights dequantized, then PyTorch's GEMM (runtime/linear.py gemm())
TACTICS_MODES = ("fast", "exhaustive", "none")  # build.tactics
TACTIC_PREFETCH = "prefetch"  # tactics' software weight prefetch distance: {"bytes", "step_us"}
PREFETCH_BYTES_ENV = "KILN_PREFETCH_BYTES"  # sets the distance at load, over the engine's tactic


def linear_prefix(weight_name: str) -> str:
    """layers.3.mlp.down.weight -> layers.3.mlp.down"""
    return weight_name.removesuffix(".weight")


def linear_tensor(prefix: str, part: str) -> str:
    return f"{prefix}.{part}"


# --- Triton model repository ------------------------------------------------------------
# Model roles and their names under `triton.model_names` (kiln's own, or TensorRT-LLM's
# inflight_batcher_llm names so its clients need no change). Tensor names are TensorRT-LLM's
# in both.
ROLE_PREPROCESSING = "preprocessing"
ROLE_ENGINE = "engine"
ROLE_POSTPROCESSING = "postprocessing"
ROLE_ENSEMBLE = "ensemble"
ROLE_BLS = "bls"
MODEL_NAME_SETS = {
    "kiln": {ROLE_PREPROCESSING: "preprocessing", ROLE_ENGINE: "kiln", ROLE_POSTPROCESSING: "postprocessing",
             ROLE_ENSEMBLE: "ensemble", ROLE_BLS: "kiln_bls"},
    "tensorrt_llm": {ROLE_PREPROCESSING: "preprocessing", ROLE_ENGINE: "tensorrt_llm",
                     ROLE_POSTPROCESSING: "postprocessing", ROLE_ENSEMBLE: "ensemble",
                     ROLE_BLS: "tensorrt_llm_bls"},
}
MODEL_ENSEMBLE = MODEL_NAME_SETS["kiln"][ROLE_ENSEMBLE]  # what kiln's client calls by default
# config.pbtxt parameters (paths relative to the repository)
ENGINE_DIR_PARAMETER = "engine_dir"
TOKENIZER_DIR_PARAMETER = "tokenizer_dir"
PREPROCESSING_MODEL_PARAMETER = "preprocessing_model_name"  # the BLS model's partners
ENGINE_MODEL_PARAMETER = "tensorrt_llm_model_name"
POSTPROCESSING_MODEL_PARAMETER = "postprocessing_model_name"
# what `kiln serve` tells the models it starts (environment variables of the server)
RUNTIME_OPTIONS_ENV = "KILN_RUNTIME_OPTIONS"  # JSON run-time options applied over the engine's
SERVER_GRPC_URL_ENV = "KILN_TRITON_GRPC_URL"  # host:port of the server's own gRPC endpoint (the BLS
# streams from the engine model through it)
# a request parameter: the engine model starts its error messages with the Triton status code
# name and ERROR_CODE_SEPARATOR (a gRPC stream carries an error's message, not its code)
CODED_ERRORS_PARAMETER = "kiln_coded_errors"
ERROR_CODE_SEPARATOR = ": "

# ensemble and BLS inputs (TensorRT-LLM's names, types and dims)
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
BAD_WORDS = "bad_words"
STOP_WORDS = "stop_words"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
END_ID = "end_id"
PAD_ID = "pad_id"
TOP_K = "top_k"
TOP_P = "top_p"
TEMPERATURE = "temperature"
LENGTH_PENALTY = "length_penalty"
REPETITION_PENALTY = "repetition_penalty"
MIN_TOKENS = "min_tokens"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
SEED = "seed"
RETURN_LOG_PROBS = "return_log_probs"
RETURN_CONTEXT_LOGITS = "return_context_logits"
RETURN_GENERATION_LOGITS = "return_generation_logits"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
BEAM_WIDTH = "beam_width"
NUM_RETURN_SEQUENCES = "num_return_sequences"
STREAM = "stream"
EMBEDDING_BIAS_WORDS = "embedding_bias_words"
EMBEDDING_BIAS_WEIGHTS = "embedding_bias_weights"
LORA_TASK_ID = "lora_task_id"
LORA_WEIGHTS = "lora_weights"
LORA_CONFIG = "lora_config"
PROMPT_EMBEDDING_TABLE = "prompt_embedding_table"
PROMPT_VOCAB_SIZE = "prompt_vocab_size"
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"
GUIDED_DECODING_GUIDE = "guided_decoding_guide"
# older names, accepted as aliases of the newer ones (both given: they must agree)
RANDOM_SEED = "random_seed"  # = seed
MIN_LENGTH = "min_length"  # = min_tokens
ALIASES = {SEED: RANDOM_SEED, MIN_TOKENS: MIN_LENGTH}  # input -> its older alias

# ensemble and BLS outputs
TEXT_OUTPUT = "text_output"
CUM_LOG_PROBS = "cum_log_probs"
OUTPUT_LOG_PROBS = "output_log_probs"
CONTEXT_LOGITS = "context_logits"
GENERATION_LOGITS = "generation_logits"
BATCH_INDEX = "batch_index"
SEQUENCE_INDEX = "sequence_index"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"

# engine model (tensorrt_llm) inputs beyond the shared ones above
INPUT_IDS = "input_ids"
INPUT_LENGTHS = "input_lengths"
REQUEST_OUTPUT_LEN = "request_output_len"
STOP_WORDS_LIST = "stop_words_list"
BAD_WORDS_LIST = "bad_words_list"
EMBEDDING_BIAS = "embedding_bias"
RUNTIME_TOP_K = "runtime_top_k"
RUNTIME_TOP_P = "runtime_top_p"
LEN_PENALTY = "len_penalty"
EARLY_STOPPING = "early_stopping"
STOP = "stop"  # with the id of a running request: end it
STREAMING = "streaming"
DRAFT_INPUT_IDS = "draft_input_ids"
# engine model outputs
OUTPUT_IDS = "output_ids"
SEQUENCE_LENGTH = "sequence_length"
PREFIX_IDS = "prefix_ids"  # kiln: the tokens before output_ids that decoding needs for context

# preprocessing
QUERY = "QUERY"
REQUEST_OUTPUT_LEN_UPPER = "REQUEST_OUTPUT_LEN"
BAD_WORDS_DICT = "BAD_WORDS_DICT"
STOP_WORDS_DICT = "STOP_WORDS_DICT"
EMBEDDING_BIAS_WORDS_UPPER = "EMBEDDING_BIAS_WORDS"
EMBEDDING_BIAS_WEIGHTS_UPPER = "EMBEDDING_BIAS_WEIGHTS"
END_ID_UPPER = "END_ID"
PAD_ID_UPPER = "PAD_ID"
INPUT_ID = "INPUT_ID"
REQUEST_INPUT_LEN = "REQUEST_INPUT_LEN"
BAD_WORDS_IDS = "BAD_WORDS_IDS"
STOP_WORDS_IDS = "STOP_WORDS_IDS"
EMBEDDING_BIAS_UPPER = "EMBEDDING_BIAS"
OUT_END_ID = "OUT_END_ID"
OUT_PAD_ID = "OUT_PAD_ID"
# postprocessing
TOKENS_BATCH = "TOKENS_BATCH"
SEQUENCE_LENGTH_UPPER = "SEQUENCE_LENGTH"
PREFIX_IDS_UPPER = "PREFIX_IDS"  # kiln: optional, the engine's prefix_ids (streamed text stays whole)
OUTPUT = "OUTPUT"

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
CKPT_HEAD_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")  # Qwen3, Gemma 3
CKPT_OUTPUT_NORMS = ("attention.out_norm.weight", "mlp.out_norm.weight")  # Gemma 3 (spec.output_norms)
CKPT_DENSE_MLP = ("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")  # (a Mixture-of-Experts layer instead has:)
CKPT_ROUTER = "mlp.router.weight"
CKPT_SHARED_GATE = "mlp.shared_gate.weight"  # (and CKPT_DENSE_MLP: its shared expert, where it has one)
CKPT_EXPERT = ("gate.weight", "up.weight", "down.weight")  # each as expert_tensor(e, name)

# engine model custom metrics (Triton metrics endpoint, Prometheus text format)
METRIC_KV_BLOCKS = "kiln_kv_cache_blocks"
METRIC_REQUESTS = "kiln_requests"
METRIC_PREEMPTIONS = "kiln_preemptions"
METRIC_PREFIX_HIT_RATE = "kiln_prefix_hit_rate"

# runtime.step_log: one JSON object a step, these keys. time: when it ended (Unix seconds); ms:
# the model's share (schedule and sampling bookkeeping excluded); sequences and tokens: what it
# computed; decode_tokens: those of sequences past their prompt computing their latest token (the
# rest is prefill, or recomputation after a preemption); queued: requests waiting while it ran;
# kv_blocks_used: of the pool's blocks, after it.
STEP_LOG_FIELDS = ("time", "step", "ms", "sequences", "tokens", "decode_tokens", "queued", "kv_blocks_used")

# --- TensorRT-LLM checkpoint (config.json + rank0.safetensors; kiln export / import) -------
TRTLLM_CONFIG = "config.json"
TRTLLM_WEIGHTS = "rank0.safetensors"
TRTLLM_EMBED = "transformer.vocab_embedding.weight"
TRTLLM_FINAL_NORM = "transformer.ln_f.weight"
TRTLLM_LM_HEAD = "lm_head.weight"
TRTLLM_LAYER = "transformer.layers.{}."
TRTLLM_INPUT_NORM = "input_layernorm.weight"
TRTLLM_POST_NORM = "post_layernorm.weight"
TRTLLM_QKV = "attention.qkv"
TRTLLM_DENSE = "attention.dense"
TRTLLM_MLP_FC = "mlp.fc"  # TensorRT-LLM's names: fc is the gate projection, gate the up projection
TRTLLM_MLP_GATE = "mlp.gate"
TRTLLM_MLP_PROJ = "mlp.proj"
TRTLLM_KV_SCALE = "attention.kv_cache_scaling_factor"
TRTLLM_WEIGHT = "weight"
TRTLLM_BIAS = "bias"
TRTLLM_WEIGHTS_SCALE = "weights_scaling_factor"
TRTLLM_ACTIVATION_SCALE = "activation_scaling_factor"
TRTLLM_PREQUANT_SCALE = "prequant_scaling_factor"
TRTLLM_FP8 = "FP8"  # quantization.quant_algo
TRTLLM_W4A16_AWQ = "W4A16_AWQ"
TRTLLM_KV_INT8 = "INT8"  # quantization.kv_cache_quant_algo
TRTLLM_KV_FP8 = "FP8"
TRTLLM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                        "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# TensorRT-LLM's Qwen models (its qwen convert.py): config.json qwen_type and attn_bias; Qwen3's
# RMSNorms over each query / key head
TRTLLM_QWEN_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe"}
# Qwen2-MoE's shared expert: mlp.shared_expert.fc (up rows, then gate rows) and .proj, and its gate
# mlp.shared_expert_gate [1, hidden]; config moe_shared_expert_intermediate_size
TRTLLM_SHARED_EXPERT_FC = "mlp.shared_expert.fc"
TRTLLM_SHARED_EXPERT_PROJ = "mlp.shared_expert.proj"
TRTLLM_SHARED_EXPERT_GATE = "mlp.shared_expert_gate"
TRTLLM_Q_NORM = "attention.q_layernorm.weight"
TRTLLM_K_NORM = "attention.k_layernorm.weight"
# Phi-3 (TensorRT-LLM's phi3 convert.py): gate_up is one module, mlp.fc, its up rows before its gate
# rows; config.json "rotary_pct" (partial rotary) and, for LongRoPE, position_embedding_type long_rope
TRTLLM_LONG_ROPE = "long_rope"
# Mixture-of-Experts (TensorRT-LLM's MOE module, as its llama convert.py writes Mixtral): mlp.router
# float32 [experts, hidden]; mlp.fc [experts, 2 x width, hidden], each expert's up rows (w3) before its
# gate rows (w1); mlp.proj [experts, hidden, width]; config.json "moe": num_experts, top_k,
# normalization_mode (TRTLLM_MOE_NORMALIZATION)
TRTLLM_MLP_ROUTER = "mlp.router"
TRTLLM_MOE = "moe"
TRTLLM_MOE_NORMALIZATION = {0: False, 1: True}  # NONE / RENORMALIZE -> the top-k weights rescaled to sum to 1

# --- NVIDIA Model Optimizer's Hugging Face export (read by model.format: hf) --------------
MODELOPT_QUANT_CONFIG = "hf_quant_config.json"
MODELOPT_WEIGHT_SCALE = "weight_scale"
MODELOPT_INPUT_SCALE = "input_scale"
MODELOPT_PRE_QUANT_SCALE = "pre_quant_scale"
MODELOPT_FP8 = "FP8"
MODELOPT_W4A16_AWQ = "W4A16_AWQ"
MODELOPT_W8A8_SQ = "W8A8_SQ_PER_CHANNEL"
MODELOPT_K_SCALE = "self_attn.k_proj.k_scale"  # FP8 KV cache: one scale per layer for K, one for V
MODELOPT_V_SCALE = "self_attn.v_proj.v_scale"
