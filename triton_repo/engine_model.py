"""Triton engine model (Python backend, decoupled): requests go to the kiln Executor, which
batches them in flight; one dispatcher thread sends each request's responses back.

It translates tensors to requests and executor responses back to tensors; nothing else."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kiln import constants as names
from kiln.triton_repo.engine_request import OutputOptions
from kiln.triton_repo.model_utils import error_response, input_array, optional_scalar, parameter, repo_path, \
    wants_coded_errors

log = logging.getLogger("kiln.triton")

POLL_S = 0.05  # the dispatcher's longest wait for responses
CANCEL_CHECK_S = 0.2  # how often it asks whether a client cancelled (each ask is a call to Triton)
SEND_WORKERS = 8  # responses go out on these threads: a send that blocks holds up its own stream only
METRICS_INTERVAL_S = 0.5  # gauges refresh this often, and when a request ends (not per token:
# stats() takes the executor's lock)


class EngineMetrics:
    """The executor's state as Triton custom metrics (gauges on the metrics port's /metrics):
    kiln_kv_cache_blocks{state=total|used|peak|free}, kiln_requests{state=running|queued},
    kiln_preemptions, kiln_prefix_hit_rate."""

    def __init__(self, model_name: str):
        import triton_python_backend_utils as pb_utils

        def family(name: str, description: str):
            return pb_utils.MetricFamily(name=name, description=description, kind=pb_utils.MetricFamily.GAUGE)

        blocks = family(names.METRIC_KV_BLOCKS, "KV cache blocks by state (peak: most in use since start)")
        requests = family(names.METRIC_REQUESTS, "requests running in the engine or queued for it")
        preemptions = family(names.METRIC_PREEMPTIONS, "sequences preempted (recomputed later) since start")
        hit_rate = family(names.METRIC_PREFIX_HIT_RATE, "share of prompt tokens served from cached KV blocks")
        label = {"model": model_name}
        self.gauges = {
            "blocks_total": blocks.Metric(labels={**label, "state": "total"}),
            "blocks_used": blocks.Metric(labels={**label, "state": "used"}),
            "blocks_used_peak": blocks.Metric(labels={**label, "state": "peak"}),
            "blocks_free": blocks.Metric(labels={**label, "state": "free"}),
            "running": requests.Metric(labels={**label, "state": "running"}),
            "queued": requests.Metric(labels={**label, "state": "queued"}),
            "preemptions": preemptions.Metric(labels=label),
            "prefix_hit_rate": hit_rate.Metric(labels=label),
        }
        self._families = (blocks, requests, preemptions, hit_rate)  # keep them registered

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            gauge.set(float(stats[key]))


class Active:
    """One request in flight: what it asked for, what it has produced, and its responses waiting
    to be sent (in order, by one send worker at a time; never under the model's lock)."""

    def __init__(self, sender, triton_id: str, prompt_ids: list[int], options: OutputOptions, assembler,
                 coded_errors: bool = False):
        self.sender, self.triton_id, self.prompt_ids = sender, triton_id, prompt_ids
        self.coded_errors = coded_errors  # error messages start with their status code
        self.options, self.assembler = options, assembler
        # non-streaming: everything, sent at the end
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.generation_logits: list = []
        self.context_logits = None
        self.outbox: deque = deque()  # (response or None, flags)
        self.sending = False  # a send worker is draining the outbox
        self.outbox_lock = threading.Lock()
        self.failed = False  # ended with an error by the dispatcher: nothing more is sent


def _batched(array: np.ndarray) -> np.ndarray:
    return array[np.newaxis]


def output_arrays(active: Active, tokens: list[int], prefix: list[int], log_probs: list[float],
                  context_logits, generation_logits: list, streaming: bool) -> dict[str, np.ndarray]:
    """One response's tensors (batch of 1, one beam). Log probs, logits and token counts are
    sent only when the request asked for them (an ensemble forwards what is there)."""
    options = active.options
    output_ids = tokens if streaming or options.exclude_input_in_output else active.prompt_ids + tokens
    arrays = {
        names.OUTPUT_IDS: np.array(output_ids, dtype=np.int32).reshape(1, -1),
        names.SEQUENCE_LENGTH: np.array([len(output_ids)], dtype=np.int32),
        names.PREFIX_IDS: np.array(prefix, dtype=np.int32),
        names.BATCH_INDEX: np.array([0], dtype=np.int32),
        names.SEQUENCE_INDEX: np.array([0], dtype=np.int32),
    }
    if options.return_log_probs:
        arrays[names.CUM_LOG_PROBS] = np.array([sum(log_probs)], dtype=np.float32)
        arrays[names.OUTPUT_LOG_PROBS] = np.array(log_probs, dtype=np.float32).reshape(1, -1)
    if options.return_context_logits and context_logits is not None:
        arrays[names.CONTEXT_LOGITS] = context_logits.numpy().astype(np.float32)
    if options.return_generation_logits and generation_logits:
        arrays[names.GENERATION_LOGITS] = np.stack([g.numpy() for g in generation_logits]).astype(np.float32)[np.newaxis]
    if options.return_num_input_tokens:
        arrays[names.NUM_INPUT_TOKENS] = np.array([len(active.prompt_ids)], dtype=np.int32)
    if options.return_num_output_tokens:
        arrays[names.NUM_OUTPUT_TOKENS] = np.array([len(tokens)], dtype=np.int32)
    return {name: _batched(array) for name, array in arrays.items()}


class TritonPythonModel:
    def initialize(self, args):
        from kiln.runtime.detokenizer import TokenBytes
        from kiln.runtime.llm import LLM

        overrides = json.loads(os.environ.get(names.RUNTIME_OPTIONS_ENV) or "{}")  # kiln serve --max-queue-size ...
        self.llm = LLM(repo_path(args, parameter(args, names.ENGINE_DIR_PARAMETER)), **overrides)
        self.executor = self.llm.executor
        # chunks are cut where text can be decoded whole; postprocessing / BLS make the text
        self.token_bytes = TokenBytes.of(self.llm.tokenizer)
        self.active: dict[int, Active] = {}
        self.lock = threading.Lock()  # guards `active` only; nothing is sent while it is held
        self.senders = ThreadPoolExecutor(SEND_WORKERS, thread_name_prefix="kiln-send")
        self.stopping = threading.Event()
        self.metrics = EngineMetrics(args["model_name"])
        self.dispatcher = threading.Thread(target=self._dispatch, name="kiln-dispatch", daemon=True)
        self.dispatcher.start()

    @staticmethod
    def _response(arrays: dict[str, np.ndarray]):
        import triton_python_backend_utils as pb_utils

        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        from kiln.errors import KilnError
        from kiln.runtime.llm import ChunkAssembler
        from kiln.triton_repo.engine_request import parse_engine_request

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            coded = wants_coded_errors(request)
            try:
                if optional_scalar(request, names.STOP, False):
                    self._stop(request.request_id())
                    sender.send(flags=final)
                    continue
                prompt_ids, params, options = parse_engine_request(lambda name, r=request: input_array(r, name))
                state = Active(sender, request.request_id(), prompt_ids, options,
                               ChunkAssembler(self.llm.tokenizer, prompt_ids, self.token_bytes), coded)
                with self.lock:  # registered before the dispatcher can see its first response
                    self.active[self.executor.enqueue(prompt_ids, params)] = state
            except (KilnError, ValueError, TypeError) as exc:  # what the client sent
                sender.send(error_response(f"{type(exc).__name__}: {exc}", "INVALID_ARG", coded), flags=final)
        return None

    def _stop(self, triton_id: str) -> None:
        """TensorRT-LLM's `stop`: end the running request that has this request id."""
        from kiln.errors import RequestError

        with self.lock:
            running = [rid for rid, state in self.active.items() if triton_id and state.triton_id == triton_id]
        if not running:
            raise RequestError(f"stop: no running request has the id {triton_id!r}")
        for request_id in running:
            self.executor.cancel(request_id)

    def _dispatch(self):
        """The dispatcher thread: one pass after another until finalize. A pass that fails is logged
        and the next one runs, so no fault of one request can stop the responses of the others."""
        import triton_python_backend_utils as pb_utils

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        due = {"metrics": 0.0, "cancel_check": 0.0}
        while not self.stopping.is_set():
            try:
                self._dispatch_pass(final, due)
            except Exception:
                log.exception("the engine model's dispatcher pass failed; it goes on")
                time.sleep(POLL_S)

    def _dispatch_pass(self, final: int, due: dict[str, float]) -> None:
        from kiln.runtime.executor import FINISH_ERROR

        responses = self.executor.await_responses(timeout=POLL_S)
        with self.lock:
            states = [self.active.get(r.request_id) for r in responses]
            for response in responses:
                if response.finished:
                    self.active.pop(response.request_id, None)
        for response, state in zip(responses, states):
            if state is None or state.failed:
                continue
            try:
                if response.finish_reason == FINISH_ERROR:
                    code = "UNAVAILABLE" if response.busy else "INTERNAL"
                    self._post(state, error_response(response.error, code, state.coded_errors), final)
                else:
                    self._forward(state, response, final)
            except Exception as exc:  # this request's outputs could not be made: it alone fails
                log.exception("request %s: its response could not be made", state.triton_id)
                self._fail(response.request_id, state, f"internal error making the response: {exc}", final)
        now = time.monotonic()
        if now >= due["cancel_check"]:  # outside the lock: each ask is a call into Triton
            due["cancel_check"] = now + CANCEL_CHECK_S
            with self.lock:
                live = list(self.active.items())
            for request_id, state in live:
                try:
                    cancelled = state.sender.is_cancelled()
                except Exception:  # a sender that cannot say has lost its client
                    log.warning("request %s: is_cancelled failed; ending it", state.triton_id, exc_info=True)
                    cancelled = True
                if cancelled:
                    self.executor.cancel(request_id)
        # refresh when due, and whenever a request ends (per request, not per token)
        if now >= due["metrics"] or any(r.finished for r in responses):
            due["metrics"] = now + METRICS_INTERVAL_S
            self.metrics.update(self.executor.stats())

    def _fail(self, request_id: int, state: Active, message: str, final: int) -> None:
        """End one request with an error: the executor stops it and its later responses are dropped."""
        state.failed = True
        self.executor.cancel(request_id)
        with self.lock:
            self.active.pop(request_id, None)
        self._post(state, error_response(message, "INTERNAL", state.coded_errors), final)

    def _post(self, state: Active, response=None, flags=0) -> None:
        """Queue a response for its stream; a send worker takes the stream's queue in order."""
        with state.outbox_lock:
            state.outbox.append((response, flags))
            if state.sending:
                return
            state.sending = True
        self.senders.submit(self._drain, state)

    @staticmethod
    def _drain(state: Active) -> None:
        while True:
            with state.outbox_lock:
                if not state.outbox:
                    state.sending = False
                    return
                response, flags = state.outbox.popleft()
            try:  # a client that went away must not take the worker down with it
                if response is None:
                    state.sender.send(flags=flags)
                else:
                    state.sender.send(response, flags=flags)
            except Exception:
                log.warning("could not send a response (client gone?)", exc_info=True)

    def _forward(self, state: Active, response, final_flag) -> None:
        chunk = state.assembler.add(response)
        if state.options.streaming:
            if chunk is not None and (chunk.token_ids or chunk.context_logits is not None):
                arrays = output_arrays(state, chunk.token_ids, chunk.prefix_ids, chunk.log_probs,
                                       chunk.context_logits, chunk.generation_logits, streaming=True)
                self._post(state, self._response(arrays))
        elif chunk is not None:
            state.tokens += chunk.token_ids
            state.log_probs += chunk.log_probs
            state.generation_logits += chunk.generation_logits
            if chunk.context_logits is not None:
                state.context_logits = chunk.context_logits
        if response.finished:
            if not state.options.streaming:
                arrays = output_arrays(state, state.tokens, [], state.log_probs, state.context_logits,
                                       state.generation_logits, streaming=False)
                self._post(state, self._response(arrays))
            self._post(state, flags=final_flag)

    def finalize(self):
        self.stopping.set()
        self.dispatcher.join()
        self.senders.shutdown(wait=False, cancel_futures=False)
        self.llm.close()
