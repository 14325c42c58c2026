"""Triton BLS model (`tensorrt_llm_bls` / `kiln_bls`): the ensemble's interface as one Python
model that calls preprocessing and the engine model itself (Business Logic Scripting).

Each request runs on its own thread, so requests overlap and the engine batches them in
flight. The engine's streamed token chunks are detokenized here with their prefix ids (the
text of a multi-byte character is never split). The engine model is streamed from over the
server's own gRPC endpoint where `kiln serve` gave its address (see engine_calls.py for why), in
process otherwise. A client that cancels gets its engine request ended at once."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

import numpy as np

from kiln import constants as names
from kiln.triton_repo.engine_calls import GrpcEngine, InProcessEngine, RequestFailed
from kiln.triton_repo.model_configs import PREPROCESSING_TO_ENGINE, RESULT_OUTPUTS, TEXT_INPUTS, TO_ENGINE, \
    TO_PREPROCESSING
from kiln.triton_repo.model_utils import engine_tokenizer, error_code, error_response, input_array, parameter, \
    refuse_unknown_parameters

log = logging.getLogger("kiln.triton.bls")


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.preprocessing = parameter(args, names.PREPROCESSING_MODEL_PARAMETER)
        engine = parameter(args, names.ENGINE_MODEL_PARAMETER)
        url = os.environ.get(names.SERVER_GRPC_URL_ENV)
        if url:
            self.engine = GrpcEngine(url, engine)
        else:
            outputs = [names.OUTPUT_IDS, names.SEQUENCE_LENGTH, names.PREFIX_IDS] + [s.name for s in RESULT_OUTPUTS]
            self.engine = InProcessEngine(engine, outputs)
        log.info("BLS streams from %s %s", engine, f"over gRPC at {url}" if url else "in process")
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    def _serve(self, request) -> None:
        import triton_python_backend_utils as pb_utils

        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except RequestFailed as exc:
            sender.send(error_response(str(exc), exc.code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # report, keep serving
            log.exception("BLS request failed")
            sender.send(error_response(f"{type(exc).__name__}: {exc}"),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _generate(self, request, sender) -> None:
        import triton_python_backend_utils as pb_utils

        try:
            refuse_unknown_parameters(request, [spec.name for spec in TEXT_INPUTS])
        except ValueError as exc:
            raise RequestFailed(str(exc), "INVALID_ARG") from None
        given = {spec.name: input_array(request, spec.name) for spec in TEXT_INPUTS}
        given = {name: array for name, array in given.items() if array is not None}
        pre = pb_utils.InferenceRequest(
            model_name=self.preprocessing, requested_output_names=list(PREPROCESSING_TO_ENGINE),
            inputs=[pb_utils.Tensor(TO_PREPROCESSING[k], v) for k, v in given.items() if k in TO_PREPROCESSING],
        ).exec()
        if pre.has_error():
            raise RequestFailed(pre.error().message(), error_code(pre.error()))
        engine_inputs = {engine: pb_utils.get_output_tensor_by_name(pre, out).as_numpy()
                         for out, engine in PREPROCESSING_TO_ENGINE.items()}
        engine_inputs.update((TO_ENGINE[k], v) for k, v in given.items() if k in TO_ENGINE)
        with contextlib.closing(self.engine.stream(engine_inputs, uuid.uuid4().hex, sender.is_cancelled)) as stream:
            self._send_text(stream, sender)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send_text(self, stream, sender) -> None:
        import triton_python_backend_utils as pb_utils

        from kiln.runtime.detokenizer import decode_delta

        for outputs in stream:
            tokens = outputs.get(names.OUTPUT_IDS)
            if tokens is None:
                continue
            ids = [int(t) for t in tokens.reshape(-1)]
            prefix = [int(t) for t in outputs[names.PREFIX_IDS].reshape(-1)]
            text = decode_delta(self.tokenizer, prefix, ids).encode("utf-8")
            # flat, as TensorRT-LLM's BLS (its postprocessing's OUTPUT) returns it: [1] for one request
            tensors = [pb_utils.Tensor(names.TEXT_OUTPUT, np.array([text], dtype=np.object_))]
            tensors += [pb_utils.Tensor(spec.name, outputs[spec.name]) for spec in RESULT_OUTPUTS
                        if spec.name in outputs]  # those the request asked for
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)
