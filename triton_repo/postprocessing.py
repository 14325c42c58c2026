"""Triton `postprocessing` model: token ids -> text, stateless per response.

Each response of the engine carries the new tokens and the few tokens before them; the text is
decode(prefix + new) minus decode(prefix), the same delta `LLM.stream` yields, so streamed text
never breaks a multi-byte character and keeps SentencePiece spacing."""
from __future__ import annotations

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_utils import engine_tokenizer, error_response, required


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        from kiln.runtime.detokenizer import decode_delta

        responses = []
        for request in requests:
            try:
                tokens = required(request, names.TOKENS_BATCH)  # [batch, beams, len]
                prefixes = required(request, names.PREFIX_BATCH)  # [batch, len]
            except ValueError as exc:
                responses.append(error_response(f"postprocessing: {exc}"))
                continue
            texts = []
            for row, prefix in zip(tokens.reshape(tokens.shape[0], -1, tokens.shape[-1]), prefixes):
                new = [int(t) for t in row[0] if t >= 0]  # -1 pads
                texts.append(decode_delta(self.tokenizer, [int(t) for t in prefix if t >= 0], new).encode())
            out = np.array(texts, dtype=np.object_).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(names.TEXT_OUTPUT, out)]))
        return responses
