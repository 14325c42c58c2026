"""Triton engine model (Python backend, decoupled): runs the kiln runtime and streams ids.

Translates tensors to a generation request and runtime chunks back to responses; nothing
else. Requests are served one at a time in this version."""
from __future__ import annotations

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_utils import error_response, optional_scalar, parameter, repo_path, required


class TritonPythonModel:
    def initialize(self, args):
        from kiln.runtime.llm import LLM

        self.llm = LLM(repo_path(args, parameter(args, names.ENGINE_DIR_PARAMETER)))

    def _request(self, request):
        from kiln.runtime.sampling import SamplingParams

        ids = required(request, names.INPUT_IDS).reshape(-1)
        length = optional_scalar(request, names.INPUT_LENGTHS, ids.size)
        params = SamplingParams(
            max_tokens=int(required(request, names.REQUEST_OUTPUT_LEN).reshape(-1)[0]),
            temperature=float(optional_scalar(request, names.TEMPERATURE, 0.0)),
            top_k=int(optional_scalar(request, names.RUNTIME_TOP_K, 0)),
            top_p=float(optional_scalar(request, names.RUNTIME_TOP_P, 1.0)),
            seed=optional_scalar(request, names.RANDOM_SEED),
            end_id=optional_scalar(request, names.END_ID),
        )
        streaming = bool(optional_scalar(request, names.STREAMING, False))
        return [int(t) for t in ids[:length]], params, streaming

    @staticmethod
    def _response(tokens: list[int], prefix: list[int]):
        import triton_python_backend_utils as pb_utils

        ids = np.array(tokens, dtype=np.int32).reshape(1, 1, -1)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(names.OUTPUT_IDS, ids),
                pb_utils.Tensor(names.SEQUENCE_LENGTH, np.array([[len(tokens)]], dtype=np.int32)),
                pb_utils.Tensor(names.PREFIX_IDS, np.array(prefix, dtype=np.int32).reshape(1, -1)),
            ]
        )

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        from kiln.errors import KilnError

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt_ids, params, streaming = self._request(request)
                chunks = self.llm.stream(prompt_ids, params)
                if streaming:
                    for chunk in chunks:
                        if chunk.token_ids:
                            sender.send(self._response(chunk.token_ids, chunk.prefix_ids))
                else:
                    collected = list(chunks)
                    tokens = [t for c in collected for t in c.token_ids]
                    sender.send(self._response(tokens, collected[0].prefix_ids if tokens else []))
                sender.send(flags=final)
            except (KilnError, ValueError, TypeError) as exc:
                sender.send(error_response(f"{type(exc).__name__}: {exc}"), flags=final)
        return None
