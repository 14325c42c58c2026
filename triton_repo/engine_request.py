"""Engine-model requests: TensorRT-LLM's tensors -> (prompt ids, SamplingParams, output options).

Pure numpy, so it is tested without a server. Every name is in kiln.constants, the older
names (random_seed, min_length) among them as aliases of the newer ones (constants.ALIASES). Inputs kiln cannot honour get
a RequestError naming them instead of being ignored."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln import constants as names
from kiln.errors import RequestError
from kiln.runtime.sampling import SamplingParams, Words

Get = Callable[[str], "np.ndarray | None"]  # an input tensor by name (batch dim included), or None

UNSUPPORTED = {  # input -> why it is refused when given
    names.LORA_TASK_ID: "LoRA adapters are not supported by kiln engines",
    names.LORA_WEIGHTS: "LoRA adapters are not supported by kiln engines",
    names.LORA_CONFIG: "LoRA adapters are not supported by kiln engines",
    names.PROMPT_EMBEDDING_TABLE: "prompt tuning tables are not supported by kiln engines",
    names.PROMPT_VOCAB_SIZE: "prompt tuning tables are not supported by kiln engines",
    names.GUIDED_DECODING_GUIDE_TYPE: "guided decoding is not supported by kiln engines",
    names.GUIDED_DECODING_GUIDE: "guided decoding is not supported by kiln engines",
    names.DRAFT_INPUT_IDS: "speculative decoding (draft tokens) is not supported by kiln engines",
}


@dataclass(frozen=True)
class OutputOptions:
    streaming: bool = False
    exclude_input_in_output: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    pad_id: int | None = None


def decode_words(array: np.ndarray | None, name: str = "words list") -> Words:
    """TensorRT-LLM's word-list tensor [1, 2, N] (flat ids; cumulative end offsets, -1 padded)
    -> token sequences. Errors name the input."""
    if array is None or array.size == 0:
        return ()
    if array.ndim == 3:
        if array.shape[0] != 1:
            raise RequestError(f"{name} must be for one request, got shape {list(array.shape)}")
        array = array[0]
    if array.ndim != 2 or array.shape[0] != 2:
        raise RequestError(f"{name} must have shape [2, N] (ids, offsets), got {list(array.shape)}")
    ids, offsets = array[0].tolist(), array[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise RequestError(f"{name} offsets {offsets} are not increasing ends within {len(ids)} ids")
        words.append(tuple(int(t) for t in ids[start:end]))
        start = end
    return tuple(words)


def _scalar(get: Get, name: str, default=None):
    array = get(name)
    if array is None:
        return default
    if array.size != 1:
        raise RequestError(f"input {name!r} must hold one value per request, got shape {list(array.shape)}")
    return array.reshape(-1)[0].item()


def _aliased(get: Get, name: str, default=None):
    """A value given under its name or its older alias (kiln.constants.ALIASES; both: they must agree)."""
    alias = names.ALIASES[name]
    value, old = _scalar(get, name), _scalar(get, alias)
    if value is not None and old is not None and value != old:
        raise RequestError(f"{name!r} ({value}) and its alias {alias!r} ({old}) disagree")
    return default if value is None and old is None else (value if value is not None else old)


def parse_engine_request(get: Get) -> tuple[list[int], SamplingParams, OutputOptions]:
    for name, why in UNSUPPORTED.items():
        array = get(name)
        if array is not None and array.size:
            raise RequestError(f"input {name!r}: {why}")
    beams = int(_scalar(get, names.BEAM_WIDTH, 1))
    if beams != 1:
        raise RequestError(f"beam_width {beams}: kiln decodes one beam per request (beam search is not "
                           "supported yet); send beam_width 1")
    sequences = int(_scalar(get, names.NUM_RETURN_SEQUENCES, 1))
    if sequences != 1:
        raise RequestError(f"num_return_sequences {sequences}: kiln returns one sequence per request; "
                           "send the request several times with different seeds")
    ids = get(names.INPUT_IDS)
    if ids is None:
        raise RequestError(f"input {names.INPUT_IDS!r} is required")
    ids = ids.reshape(-1)
    length = int(_scalar(get, names.INPUT_LENGTHS, ids.size))
    if not 0 <= length <= ids.size:
        raise RequestError(f"input_lengths {length} is not within the {ids.size} input_ids given")
    output_len = _scalar(get, names.REQUEST_OUTPUT_LEN)
    if output_len is None:
        raise RequestError(f"input {names.REQUEST_OUTPUT_LEN!r} is required")
    end_id = _scalar(get, names.END_ID)
    bias = get(names.EMBEDDING_BIAS)
    seed = _aliased(get, names.SEED)
    params = SamplingParams(
        max_tokens=int(output_len),
        temperature=float(_scalar(get, names.TEMPERATURE, 0.0)),
        top_k=int(_scalar(get, names.RUNTIME_TOP_K, 0)),
        top_p=float(_scalar(get, names.RUNTIME_TOP_P, 1.0)),
        seed=None if seed is None else int(seed),
        end_id=None if end_id is None else int(end_id),  # -1: never end early (TensorRT-LLM)
        min_tokens=int(_aliased(get, names.MIN_TOKENS, 0)),
        repetition_penalty=float(_scalar(get, names.REPETITION_PENALTY, 1.0)),
        presence_penalty=float(_scalar(get, names.PRESENCE_PENALTY, 0.0)),
        frequency_penalty=float(_scalar(get, names.FREQUENCY_PENALTY, 0.0)),
        stop_words=decode_words(get(names.STOP_WORDS_LIST), names.STOP_WORDS_LIST),
        bad_words=decode_words(get(names.BAD_WORDS_LIST), names.BAD_WORDS_LIST),
        embedding_bias=tuple(bias.reshape(-1).tolist()) if bias is not None and bias.size else None,
        return_log_probs=bool(_scalar(get, names.RETURN_LOG_PROBS, False)),
        return_context_logits=bool(_scalar(get, names.RETURN_CONTEXT_LOGITS, False)),
        return_generation_logits=bool(_scalar(get, names.RETURN_GENERATION_LOGITS, False)),
    )
    pad_id = _scalar(get, names.PAD_ID)
    options = OutputOptions(
        streaming=bool(_scalar(get, names.STREAMING, False)),
        exclude_input_in_output=bool(_scalar(get, names.EXCLUDE_INPUT_IN_OUTPUT, False)),
        return_log_probs=params.return_log_probs,
        return_context_logits=params.return_context_logits,
        return_generation_logits=params.return_generation_logits,
        return_num_input_tokens=bool(_scalar(get, names.RETURN_NUM_INPUT_TOKENS, False)),
        return_num_output_tokens=bool(_scalar(get, names.RETURN_NUM_OUTPUT_TOKENS, False)),
        pad_id=None if pad_id is None else int(pad_id),
    )
    return [int(t) for t in ids[:length]], params, options
