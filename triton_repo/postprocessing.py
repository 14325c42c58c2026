"""Triton `postprocessing` model: token ids -> text, stateless per response.

TOKENS_BATCH [batch, beams, len] and SEQUENCE_LENGTH [batch, beams] as TensorRT-LLM sends
them. With kiln's optional PREFIX_IDS (the engine's prefix_ids output), the text is
decode(prefix + new) minus decode(prefix): the same delta `LLM.stream` yields, so streamed
text never breaks a multi-byte character and keeps SentencePiece spacing."""
from __future__ import annotations

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_utils import engine_tokenizer, error_response, input_array


def decode_batch(tokenizer, tokens: np.ndarray, lengths: np.ndarray | None, prefixes: np.ndarray | None) -> np.ndarray:
    """The UTF-8 texts, batch x beams of them in one flat array, as TensorRT-LLM's postprocessing
    returns them ([1] for one request of one beam; its clients read `output[0].decode()`)."""
    from kiln.runtime.detokenizer import decode_delta

    tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])
    texts = []
    for b, beams in enumerate(tokens):
        prefix = [] if prefixes is None else [int(t) for t in prefixes[b].reshape(-1) if t >= 0]
        row = []
        for k, beam in enumerate(beams):
            n = beam.size if lengths is None else int(lengths.reshape(tokens.shape[0], -1)[b, k])
            row.append(decode_delta(tokenizer, prefix, [int(t) for t in beam[:n] if t >= 0]).encode("utf-8"))
        texts += row
    return np.array(texts, dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            tokens = input_array(request, names.TOKENS_BATCH)
            if tokens is None:
                responses.append(error_response(f"postprocessing: input {names.TOKENS_BATCH!r} is required",
                                                "INVALID_ARG"))
                continue
            texts = decode_batch(self.tokenizer, tokens, input_array(request, names.SEQUENCE_LENGTH_UPPER),
                                 input_array(request, names.PREFIX_IDS_UPPER))
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(names.OUTPUT, texts)]))
        return responses
