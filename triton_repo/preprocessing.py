"""Triton `preprocessing` model: text -> token ids, and TensorRT-LLM's word lists.

QUERY -> INPUT_ID / REQUEST_INPUT_LEN; BAD_WORDS_DICT / STOP_WORDS_DICT (strings) -> the
[2, N] word-list tensors (flat ids; cumulative end offsets padded with -1);
EMBEDDING_BIAS_WORDS / _WEIGHTS -> a bias over the vocabulary; END_ID / PAD_ID passed on
(defaults: the tokenizer's end-of-sequence token)."""
from __future__ import annotations

import json
import os

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_configs import TEXT_INPUTS
from kiln.triton_repo.model_utils import (engine_tokenizer, error_response, input_array, parameter, repo_path,
                                          refuse_unknown_parameters, special_token_text)


def utf8_text(raw, name: str) -> str:
    """A STRING tensor element as text; ValueError naming the input if it is not UTF-8."""
    if not isinstance(raw, bytes):
        return str(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name!r} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at position {exc.start} "
                         f"({exc.reason})") from None


def word_list(tokenizer, words, name: str) -> list[list[int]]:
    """The token sequences of a request's words (empty strings are skipped, as TensorRT-LLM does)."""
    out = []
    for word in [] if words is None else np.asarray(words).reshape(-1):
        text = utf8_text(word, name)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids:
            out.append(ids)
    return out


def word_list_tensor(words: list[list[int]]) -> np.ndarray:
    """[1, 2, N]: flat ids, then cumulative end offsets padded with -1 (TensorRT-LLM's format)."""
    flat = [t for word in words for t in word]
    offsets = np.cumsum([len(word) for word in words]).tolist()
    width = max(len(flat), len(offsets))
    ids = flat + [0] * (width - len(flat))
    ends = offsets + [-1] * (width - len(offsets))
    return np.array([[ids, ends]], dtype=np.int32).reshape(1, 2, width)


def embedding_bias(tokenizer, words, weights, vocab_size: int) -> np.ndarray:
    if words is None and weights is None:
        return np.zeros((1, 0), dtype=np.float32)
    words = np.zeros(0, dtype=np.object_) if words is None else np.asarray(words).reshape(-1)
    weights = np.zeros(0, dtype=np.float32) if weights is None else np.asarray(weights).reshape(-1)
    if words.size != weights.size:
        raise ValueError(f"embedding_bias_words has {words.size} words but embedding_bias_weights "
                         f"{weights.size} weights")
    bias = np.zeros(vocab_size, dtype=np.float32)
    for ids, weight in zip([word_list(tokenizer, [w], names.EMBEDDING_BIAS_WORDS) for w in words], weights):
        for word in ids:
            bias[word] += weight
    return bias.reshape(1, -1)


def default_end_id(tokenizer, tokenizer_dir: str) -> int:
    """The tokenizer's end-of-sequence token, else the engine's first end id (engine.json beside
    the tokenizer folder), else -1 (TensorRT-LLM's "no end id")."""
    path = os.path.join(tokenizer_dir, names.TOKENIZER_CONFIG_JSON)
    token = None
    if os.path.exists(path):
        with open(path) as f:
            token = special_token_text(json.load(f).get("eos_token"))
    end = tokenizer.token_to_id(token) if token else None
    if end is None:
        engine_json = os.path.join(os.path.dirname(os.path.normpath(tokenizer_dir)), names.ENGINE_JSON)
        if os.path.exists(engine_json):
            with open(engine_json) as f:
                eos = json.load(f).get("model", {}).get("eos_ids") or []
            end = eos[0] if eos else None
    return -1 if end is None else end


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.end_id = default_end_id(self.tokenizer, repo_path(args, parameter(args, names.TOKENIZER_DIR_PARAMETER)))

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                refuse_unknown_parameters(request, [spec.name for spec in TEXT_INPUTS])
                outputs = self._one(lambda name, r=request: input_array(r, name))
            except (ValueError, UnicodeDecodeError) as exc:
                responses.append(error_response(f"preprocessing: {exc}", "INVALID_ARG"))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses

    def _one(self, get) -> dict[str, np.ndarray]:
        query = get(names.QUERY)
        output_len = get(names.REQUEST_OUTPUT_LEN_UPPER)
        for array, name, outer in ((query, names.QUERY, names.TEXT_INPUT),
                                   (output_len, names.REQUEST_OUTPUT_LEN_UPPER, names.MAX_TOKENS)):
            if array is None:
                raise ValueError(f"input {outer!r} ({name!r} here) is required")
        if query.size != 1:
            raise ValueError(f"{names.QUERY!r} must hold one text per request, got shape {list(query.shape)}")
        text = utf8_text(query.reshape(-1)[0], names.TEXT_INPUT)
        ids = np.array(self.tokenizer.encode(text).ids, dtype=np.int32)
        end_id, pad_id = get(names.END_ID_UPPER), get(names.PAD_ID_UPPER)
        end = int(end_id.reshape(-1)[0]) if end_id is not None else self.end_id
        pad = int(pad_id.reshape(-1)[0]) if pad_id is not None else end
        return {
            names.INPUT_ID: ids.reshape(1, -1),
            names.REQUEST_INPUT_LEN: np.array([[ids.size]], dtype=np.int32),
            names.REQUEST_OUTPUT_LEN_UPPER: output_len.astype(np.int32).reshape(1, -1),
            names.BAD_WORDS_IDS: word_list_tensor(
                word_list(self.tokenizer, get(names.BAD_WORDS_DICT), names.BAD_WORDS)),
            names.STOP_WORDS_IDS: word_list_tensor(
                word_list(self.tokenizer, get(names.STOP_WORDS_DICT), names.STOP_WORDS)),
            names.EMBEDDING_BIAS_UPPER: embedding_bias(self.tokenizer, get(names.EMBEDDING_BIAS_WORDS_UPPER),
                                                       get(names.EMBEDDING_BIAS_WEIGHTS_UPPER), self.vocab_size),
            names.OUT_END_ID: np.array([[end]], dtype=np.int32),
            names.OUT_PAD_ID: np.array([[pad]], dtype=np.int32),
        }
