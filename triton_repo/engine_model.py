"""Triton engine model (Python backend, decoupled): requests go to the kiln Executor, which
batches them in flight; one dispatcher thread sends each request's responses back.

It translates tensors to requests and executor responses back to tensors; nothing else."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kiln import constants as names
from kiln.triton_repo.model_utils import error_response, optional_scalar, parameter, repo_path, required

log = logging.getLogger("kiln.triton")

POLL_S = 0.05  # how often the dispatcher looks for cancelled requests while idle
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


@dataclass
class Active:
    sender: object
    streaming: bool
    assembler: object
    tokens: list[int] = field(default_factory=list)  # non-streaming: everything, sent at the end
    prefix: list[int] | None = None


class TritonPythonModel:
    def initialize(self, args):
        from kiln.runtime.llm import LLM

        self.llm = LLM(repo_path(args, parameter(args, names.ENGINE_DIR_PARAMETER)))
        self.executor = self.llm.executor
        self.active: dict[int, Active] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.metrics = EngineMetrics(args["model_name"])
        self.dispatcher = threading.Thread(target=self._dispatch, name="kiln-dispatch", daemon=True)
        self.dispatcher.start()

    def _parse(self, request):
        from kiln.runtime.sampling import SamplingParams

        ids = required(request, names.INPUT_IDS).reshape(-1)
        length = int(optional_scalar(request, names.INPUT_LENGTHS, ids.size))
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

        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(names.OUTPUT_IDS, np.array(tokens, dtype=np.int32).reshape(1, 1, -1)),
                pb_utils.Tensor(names.SEQUENCE_LENGTH, np.array([[len(tokens)]], dtype=np.int32)),
                pb_utils.Tensor(names.PREFIX_IDS, np.array(prefix, dtype=np.int32).reshape(1, -1)),
            ]
        )

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        from kiln.errors import KilnError
        from kiln.runtime.llm import ChunkAssembler

        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt_ids, params, streaming = self._parse(request)
                self.executor.check(prompt_ids, params)
            except (KilnError, ValueError, TypeError) as exc:
                sender.send(error_response(f"{type(exc).__name__}: {exc}"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            with self.lock:  # registered before the dispatcher can see its first response
                request_id = self.executor.enqueue(prompt_ids, params)
                self.active[request_id] = Active(sender, streaming, ChunkAssembler(self.llm.tokenizer, prompt_ids))
        return None

    def _dispatch(self):
        import triton_python_backend_utils as pb_utils

        from kiln.runtime.executor import FINISH_ERROR

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        next_metrics = 0.0
        while not self.stopping.is_set():
            responses = self.executor.await_responses(timeout=POLL_S)
            with self.lock:
                for response in responses:
                    state = self.active.get(response.request_id)
                    if state is None:
                        continue
                    if response.finish_reason == FINISH_ERROR:
                        self._send(state, error_response(response.error), final)
                    else:
                        self._forward(state, response, final)
                    if response.finished:
                        del self.active[response.request_id]
                for request_id, state in self.active.items():
                    if state.sender.is_cancelled():
                        self.executor.cancel(request_id)
            # refresh when due, and whenever a request ends (per request, not per token)
            if time.monotonic() >= next_metrics or any(r.finished for r in responses):
                self.metrics.update(self.executor.stats())
                next_metrics = time.monotonic() + METRICS_INTERVAL_S

    @staticmethod
    def _send(state: Active, response=None, flags=0) -> None:
        try:  # a client that went away must not take the dispatcher down with it
            if response is None:
                state.sender.send(flags=flags)
            else:
                state.sender.send(response, flags=flags)
        except Exception:
            log.warning("could not send a response (client gone?)", exc_info=True)

    def _forward(self, state: Active, response, final_flag) -> None:
        chunk = state.assembler.add(response)
        if state.streaming:
            if chunk is not None and chunk.token_ids:
                self._send(state, self._response(chunk.token_ids, chunk.prefix_ids))
        elif chunk is not None:
            state.tokens += chunk.token_ids
            state.prefix = chunk.prefix_ids if state.prefix is None else state.prefix
        if response.finished:
            if not state.streaming:
                self._send(state, self._response(state.tokens, state.prefix or []))
            self._send(state, flags=final_flag)

    def finalize(self):
        self.stopping.set()
        self.dispatcher.join()
        self.llm.close()
