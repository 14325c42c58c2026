"""The tensors of every model in the repository and the wiring between them, as data; the
config.pbtxt files are rendered from here. Names, types and dims are TensorRT-LLM's
(inflight_batcher_llm), so its clients work unchanged; the one addition is `prefix_ids`
(engine) -> `PREFIX_IDS` (postprocessing), which keeps streamed text whole."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln import constants as n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton's TYPE_* without the prefix
    dims: tuple[int, ...]
    optional: bool = False

    def pbtxt(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        optional = ", optional: true" if self.optional else ""
        return f'  {{ name: "{self.name}", data_type: TYPE_{self.dtype}, dims: [ {dims} ]{optional} }}'


def opt(name: str, dtype: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True)


# --- inputs the ensemble / BLS and the engine model both take, under the same name ------
SHARED_INPUTS = [
    opt(n.EXCLUDE_INPUT_IN_OUTPUT, "BOOL"),
    opt(n.END_ID, "INT32"),
    opt(n.PAD_ID, "INT32"),
    opt(n.TEMPERATURE, "FP32"),
    opt(n.REPETITION_PENALTY, "FP32"),
    opt(n.MIN_TOKENS, "INT32"),
    opt(n.MIN_LENGTH, "INT32"),
    opt(n.PRESENCE_PENALTY, "FP32"),
    opt(n.FREQUENCY_PENALTY, "FP32"),
    opt(n.SEED, "UINT64"),
    opt(n.RANDOM_SEED, "UINT64"),
    opt(n.RETURN_LOG_PROBS, "BOOL"),
    opt(n.RETURN_CONTEXT_LOGITS, "BOOL"),
    opt(n.RETURN_GENERATION_LOGITS, "BOOL"),
    opt(n.RETURN_NUM_INPUT_TOKENS, "BOOL"),
    opt(n.RETURN_NUM_OUTPUT_TOKENS, "BOOL"),
    opt(n.BEAM_WIDTH, "INT32"),
    opt(n.NUM_RETURN_SEQUENCES, "INT32"),
    opt(n.LORA_TASK_ID, "UINT64"),
    opt(n.LORA_WEIGHTS, "FP16", (-1, -1)),
    opt(n.LORA_CONFIG, "INT32", (-1, 3)),
    opt(n.PROMPT_EMBEDDING_TABLE, "FP16", (-1, -1)),
    opt(n.PROMPT_VOCAB_SIZE, "INT32"),
    opt(n.GUIDED_DECODING_GUIDE_TYPE, "STRING"),
    opt(n.GUIDED_DECODING_GUIDE, "STRING"),
]

# --- the text-level interface: ensemble and BLS ----------------------------------------
TEXT_INPUTS = [
    TensorSpec(n.TEXT_INPUT, "STRING", (1,)),
    TensorSpec(n.MAX_TOKENS, "INT32", (1,)),
    opt(n.BAD_WORDS, "STRING", (-1,)),
    opt(n.STOP_WORDS, "STRING", (-1,)),
    opt(n.TOP_K, "INT32"),
    opt(n.TOP_P, "FP32"),
    opt(n.LENGTH_PENALTY, "FP32"),
    opt(n.STREAM, "BOOL"),
    opt(n.EMBEDDING_BIAS_WORDS, "STRING", (-1,)),
    opt(n.EMBEDDING_BIAS_WEIGHTS, "FP32", (-1,)),
] + SHARED_INPUTS
RESULT_OUTPUTS = [  # what the engine returns beside the tokens, passed through to clients
    TensorSpec(n.CUM_LOG_PROBS, "FP32", (-1,)),
    TensorSpec(n.OUTPUT_LOG_PROBS, "FP32", (-1, -1)),
    TensorSpec(n.CONTEXT_LOGITS, "FP32", (-1, -1)),
    TensorSpec(n.GENERATION_LOGITS, "FP32", (-1, -1, -1)),
    TensorSpec(n.BATCH_INDEX, "INT32", (1,)),
    TensorSpec(n.SEQUENCE_INDEX, "INT32", (1,)),
    TensorSpec(n.NUM_INPUT_TOKENS, "INT32", (1,)),
    TensorSpec(n.NUM_OUTPUT_TOKENS, "INT32", (1,)),
]
TEXT_OUTPUTS = [TensorSpec(n.TEXT_OUTPUT, "STRING", (-1,))] + RESULT_OUTPUTS

# --- preprocessing ---------------------------------------------------------------------
PREPROCESSING_INPUTS = [
    # optional here, required by preprocessing itself: a streamed ensemble request missing them
    # then gets preprocessing's error (Triton's own check of a step's inputs answers such a
    # request with an empty stream)
    opt(n.QUERY, "STRING", (1,)),
    opt(n.REQUEST_OUTPUT_LEN_UPPER, "INT32", (1,)),
    opt(n.BAD_WORDS_DICT, "STRING", (-1,)),
    opt(n.STOP_WORDS_DICT, "STRING", (-1,)),
    opt(n.EMBEDDING_BIAS_WORDS_UPPER, "STRING", (-1,)),
    opt(n.EMBEDDING_BIAS_WEIGHTS_UPPER, "FP32", (-1,)),
    opt(n.END_ID_UPPER, "INT32"),
    opt(n.PAD_ID_UPPER, "INT32"),
]
PREPROCESSING_OUTPUTS = [
    TensorSpec(n.INPUT_ID, "INT32", (-1,)),
    TensorSpec(n.REQUEST_INPUT_LEN, "INT32", (1,)),
    TensorSpec(n.BAD_WORDS_IDS, "INT32", (2, -1)),
    TensorSpec(n.STOP_WORDS_IDS, "INT32", (2, -1)),
    TensorSpec(n.EMBEDDING_BIAS_UPPER, "FP32", (-1,)),
    TensorSpec(n.REQUEST_OUTPUT_LEN_UPPER, "INT32", (-1,)),
    TensorSpec(n.OUT_END_ID, "INT32", (1,)),
    TensorSpec(n.OUT_PAD_ID, "INT32", (1,)),
]
# text-level input -> preprocessing input
TO_PREPROCESSING = {
    n.TEXT_INPUT: n.QUERY,
    n.MAX_TOKENS: n.REQUEST_OUTPUT_LEN_UPPER,
    n.BAD_WORDS: n.BAD_WORDS_DICT,
    n.STOP_WORDS: n.STOP_WORDS_DICT,
    n.EMBEDDING_BIAS_WORDS: n.EMBEDDING_BIAS_WORDS_UPPER,
    n.EMBEDDING_BIAS_WEIGHTS: n.EMBEDDING_BIAS_WEIGHTS_UPPER,
}
# preprocessing output -> engine input
PREPROCESSING_TO_ENGINE = {
    n.INPUT_ID: n.INPUT_IDS,
    n.REQUEST_INPUT_LEN: n.INPUT_LENGTHS,
    n.REQUEST_OUTPUT_LEN_UPPER: n.REQUEST_OUTPUT_LEN,
    n.STOP_WORDS_IDS: n.STOP_WORDS_LIST,
    n.BAD_WORDS_IDS: n.BAD_WORDS_LIST,
    n.EMBEDDING_BIAS_UPPER: n.EMBEDDING_BIAS,
}

# --- engine (tensorrt_llm) --------------------------------------------------------------
ENGINE_INPUTS = [
    opt(n.INPUT_IDS, "INT32", (-1,)),
    TensorSpec(n.INPUT_LENGTHS, "INT32", (1,)),
    TensorSpec(n.REQUEST_OUTPUT_LEN, "INT32", (1,)),
    opt(n.STOP_WORDS_LIST, "INT32", (2, -1)),
    opt(n.BAD_WORDS_LIST, "INT32", (2, -1)),
    opt(n.EMBEDDING_BIAS, "FP32", (-1,)),
    opt(n.RUNTIME_TOP_K, "INT32"),
    opt(n.RUNTIME_TOP_P, "FP32"),
    opt(n.LEN_PENALTY, "FP32"),
    opt(n.EARLY_STOPPING, "BOOL"),
    opt(n.STOP, "BOOL"),
    opt(n.STREAMING, "BOOL"),
    opt(n.DRAFT_INPUT_IDS, "INT32", (-1,)),
] + SHARED_INPUTS
ENGINE_OUTPUTS = [
    TensorSpec(n.OUTPUT_IDS, "INT32", (-1, -1)),
    TensorSpec(n.SEQUENCE_LENGTH, "INT32", (-1,)),
    TensorSpec(n.PREFIX_IDS, "INT32", (-1,)),
] + RESULT_OUTPUTS
# text-level input -> engine input (the rest of the engine's inputs come from preprocessing)
TO_ENGINE = {  # text-level input -> engine input: the renamed ones, then the shared ones
    n.TOP_K: n.RUNTIME_TOP_K,
    n.TOP_P: n.RUNTIME_TOP_P,
    n.LENGTH_PENALTY: n.LEN_PENALTY,
    n.STREAM: n.STREAMING,
    **{spec.name: spec.name for spec in SHARED_INPUTS},
}

# --- postprocessing ---------------------------------------------------------------------
POSTPROCESSING_INPUTS = [
    TensorSpec(n.TOKENS_BATCH, "INT32", (-1, -1)),
    opt(n.SEQUENCE_LENGTH_UPPER, "INT32", (-1,)),
    opt(n.PREFIX_IDS_UPPER, "INT32", (-1,)),
]
POSTPROCESSING_OUTPUTS = [TensorSpec(n.OUTPUT, "STRING", (-1,))]
ENGINE_TO_POSTPROCESSING = {n.OUTPUT_IDS: n.TOKENS_BATCH, n.SEQUENCE_LENGTH: n.SEQUENCE_LENGTH_UPPER,
                            n.PREFIX_IDS: n.PREFIX_IDS_UPPER}


def _tensors(kind: str, specs: list[TensorSpec]) -> str:
    return f"{kind} [\n" + ",\n".join(spec.pbtxt() for spec in specs) + "\n]\n"


def _parameters(values: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def python_model(name: str, max_batch_size: int, inputs, outputs, parameters: dict[str, str],
                 instances: int = 1, decoupled: bool = False, dynamic_batching: bool = False) -> str:
    """A Python-backend model's config.pbtxt. dynamic_batching: requests that queued while the
    instance was busy reach it together, in one execute call (no queue delay is added)."""
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    text += _tensors("input", inputs) + _tensors("output", outputs) + _parameters(parameters)
    if dynamic_batching:
        text += "dynamic_batching { }\n"
    return text + f"instance_group [ {{ count: {instances}, kind: KIND_CPU }} ]\n"


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    lines = [f'    {{\n      model_name: "{model}"\n      model_version: -1']
    lines += [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    lines += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return "\n".join(lines) + "\n    }"


def ensemble(models: dict[str, str], max_batch_size: int) -> str:
    """preprocessing -> engine -> postprocessing, with TensorRT-LLM's ensemble interface."""
    wire = {name: f"_{name}" for name in PREPROCESSING_TO_ENGINE}  # internal tensors
    pre = _step(models[n.ROLE_PREPROCESSING], {v: k for k, v in TO_PREPROCESSING.items()}, wire)
    engine_inputs = {engine: wire[pre_out] for pre_out, engine in PREPROCESSING_TO_ENGINE.items()}
    engine_inputs.update({engine: text for text, engine in TO_ENGINE.items()})
    engine_outputs = {name: f"_{name}" for name in ENGINE_TO_POSTPROCESSING}
    engine_outputs.update({spec.name: spec.name for spec in RESULT_OUTPUTS})
    engine = _step(models[n.ROLE_ENGINE], engine_inputs, engine_outputs)
    post = _step(models[n.ROLE_POSTPROCESSING], {v: f"_{k}" for k, v in ENGINE_TO_POSTPROCESSING.items()},
                 {n.OUTPUT: n.TEXT_OUTPUT})
    # text_input and max_tokens are checked by preprocessing, not by Triton: given any two inputs,
    # Triton 2.51 lets a request missing them into the ensemble, whose steps then never start, and
    # a streamed request gets an empty answer instead of an error
    inputs = [replace(spec, optional=True) if spec.name in (n.TEXT_INPUT, n.MAX_TOKENS) else spec
              for spec in TEXT_INPUTS]
    return (f'name: "{models[n.ROLE_ENSEMBLE]}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            + _tensors("input", inputs) + _tensors("output", TEXT_OUTPUTS)
            + "ensemble_scheduling {\n  step [\n" + ",\n".join([pre, engine, post]) + "\n  ]\n}\n")
