"""Triton `preprocessing` model: text_input -> input_ids (the engine's tokenizer)."""
from __future__ import annotations

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_utils import engine_tokenizer, error_response, required


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                raw = required(request, names.TEXT_INPUT).reshape(-1)[0]
                text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
                max_tokens = required(request, names.MAX_TOKENS).reshape(-1)[0]
            except (ValueError, UnicodeDecodeError) as exc:
                responses.append(error_response(f"preprocessing: {exc}"))
                continue
            ids = np.array(self.tokenizer.encode(text).ids, dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor(names.INPUT_IDS, ids.reshape(1, -1)),
                        pb_utils.Tensor(names.INPUT_LENGTHS, np.array([[ids.size]], dtype=np.int32)),
                        pb_utils.Tensor(names.REQUEST_OUTPUT_LEN, np.array([[max_tokens]], dtype=np.int32)),
                    ]
                )
            )
        return responses
