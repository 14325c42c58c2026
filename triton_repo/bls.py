"""Triton BLS model (`tensorrt_llm_bls` / `kiln_bls`): the ensemble's interface as one Python
model that calls preprocessing and the engine model itself (Business Logic Scripting).

Each request runs on its own thread, so requests overlap and the engine batches them in
flight. The engine's streamed token chunks are detokenized here with their prefix ids (the
text of a multi-byte character is never split). A client that cancels the stream gets the
engine request stopped with TensorRT-LLM's `stop` input."""
from __future__ import annotations

import logging
import threading
import uuid

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_configs import PREPROCESSING_TO_ENGINE, RESULT_OUTPUTS, TEXT_INPUTS, TO_ENGINE, \
    TO_PREPROCESSING
from kiln.triton_repo.model_utils import engine_tokenizer, error_response, input_array, parameter

log = logging.getLogger("kiln.triton.bls")


class RequestFailed(Exception):
    """A step (preprocessing, the engine) answered with an error: passed on with its status code."""

    def __init__(self, error):
        from kiln.triton_repo.model_utils import error_code

        super().__init__(error.message())
        self.code = error_code(error)


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = engine_tokenizer(args)
        self.preprocessing = parameter(args, names.PREPROCESSING_MODEL_PARAMETER)
        self.engine = parameter(args, names.ENGINE_MODEL_PARAMETER)
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

        from kiln.runtime.detokenizer import decode_delta

        given = {spec.name: input_array(request, spec.name) for spec in TEXT_INPUTS}
        given = {name: array for name, array in given.items() if array is not None}
        pre = pb_utils.InferenceRequest(
            model_name=self.preprocessing, requested_output_names=list(PREPROCESSING_TO_ENGINE),
            inputs=[pb_utils.Tensor(TO_PREPROCESSING[k], v) for k, v in given.items() if k in TO_PREPROCESSING],
        ).exec()
        if pre.has_error():
            raise RequestFailed(pre.error())
        engine_inputs = [pb_utils.Tensor(engine, pb_utils.get_output_tensor_by_name(pre, out).as_numpy())
                         for out, engine in PREPROCESSING_TO_ENGINE.items()]
        engine_inputs += [pb_utils.Tensor(TO_ENGINE[k], v) for k, v in given.items() if k in TO_ENGINE]
        inner_id = uuid.uuid4().hex
        outputs = [names.OUTPUT_IDS, names.SEQUENCE_LENGTH, names.PREFIX_IDS] + [s.name for s in RESULT_OUTPUTS]
        responses = pb_utils.InferenceRequest(
            model_name=self.engine, requested_output_names=outputs, inputs=engine_inputs, request_id=inner_id,
        ).exec(decoupled=True)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stopped = False
        for response in responses:
            # Every response of the engine request is taken, up to its final one, even after the
            # client cancelled: Triton holds one of its few BLS threads until an inner request's
            # responses are all taken, and a loop that left early leaked one per cancellation
            # until every BLS call froze (seen under load with a quarter of clients cancelling).
            if stopped:
                continue
            if response.has_error():
                raise RequestFailed(response.error())
            if sender.is_cancelled():
                self._stop(inner_id, engine_inputs)  # the engine ends it: its final response follows
                stopped = True
                continue
            tokens = pb_utils.get_output_tensor_by_name(response, names.OUTPUT_IDS)
            if tokens is None:  # the engine's empty final response
                continue
            ids = [int(t) for t in tokens.as_numpy().reshape(-1)]
            prefix = [int(t) for t in pb_utils.get_output_tensor_by_name(response, names.PREFIX_IDS).as_numpy().reshape(-1)]
            text = decode_delta(self.tokenizer, prefix, ids).encode("utf-8")
            # flat, as TensorRT-LLM's BLS (its postprocessing's OUTPUT) returns it: [1] for one request
            tensors = [pb_utils.Tensor(names.TEXT_OUTPUT, np.array([text], dtype=np.object_))]
            for spec in RESULT_OUTPUTS:  # those the request asked for
                result = pb_utils.get_output_tensor_by_name(response, spec.name)
                if result is not None:
                    tensors.append(pb_utils.Tensor(spec.name, result.as_numpy()))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
        sender.send(flags=final)

    def _stop(self, inner_id: str, engine_inputs) -> None:
        import triton_python_backend_utils as pb_utils

        required = [t for t in engine_inputs if t.name() in (names.INPUT_LENGTHS, names.REQUEST_OUTPUT_LEN)]
        stop = pb_utils.InferenceRequest(
            model_name=self.engine, requested_output_names=[], request_id=inner_id,
            inputs=required + [pb_utils.Tensor(names.STOP, np.array([[True]]))],
        )
        for _ in stop.exec(decoupled=True):
            pass

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)
