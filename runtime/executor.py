"""Executor: the engine loop on a background thread, behind a narrow thread-safe API.

    enqueue(prompt_ids, params) -> request id (RequestError if the engine can never serve it)
    await_responses(request_id=None, timeout=None) -> [Response]
    cancel(request_id)
    stats()

Each step is schedule -> run -> postprocess; a sampled token goes out as a Response at once.
The model's ops release the GIL, so callers' threads keep running while a step computes.
A full queue gets error responses; the loop keeps serving the others."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kiln import constants as names
from kiln.errors import ConfigError, RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.model import KVPool
from kiln.runtime.model_runner import ModelRunner, Sample
from kiln.runtime.options import RuntimeOptions, available_memory
from kiln.runtime.sampling import SamplingParams, ends_with_stop_word
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence

log = logging.getLogger("kiln.executor")

FINISH_STOP = "stop"  # an end id or a stop word was sampled
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CANCELLED = "cancelled"
FINISH_TIMEOUT = "timeout"  # live longer than runtime.request_timeout: ends with what it has
FINISH_ERROR = "error"


@dataclass
class Response:
    request_id: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    busy: bool = False  # the error is a full queue: the same request may succeed later
    # what the request asked to get back, for the tokens of this response
    log_probs: list[float] = field(default_factory=list)
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    context_logits: torch.Tensor | None = None  # [prompt, vocab], on the first response

    def extend(self, later: "Response") -> "Response":
        """This response with a later one's tokens (and what came with them) appended; its ending is
        set by whoever ends the request"""
        self.token_ids += later.token_ids
        self.log_probs += later.log_probs
        self.generation_logits += later.generation_logits
        if self.context_logits is None:
            self.context_logits = later.context_logits
        return self


class Executor:
    """Loads the engine on its own thread and runs every step there.

    All torch work stays on that one thread: measured here, a step on a thread other than the
    one whose OpenMP team loaded the weights ran 1.6x slower at 2 threads (10 vs 16 ms a
    decode step), and tritonserver's stub calls the model from yet other threads."""

    def __init__(self, engine_dir, options: RuntimeOptions):
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine_dir, options), name="kiln-executor",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self, engine_dir, options: RuntimeOptions) -> None:
        try:
            self._setup(Engine(engine_dir), options)
        except BaseException as exc:  # reported to the constructor's caller
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _setup(self, engine: Engine, options: RuntimeOptions) -> None:
        self.engine = engine
        self.limits = engine.limits
        self.options = options
        if options.batch_invariant:
            engine.model.make_batch_invariant()
        log.info("linear routes: %s%s", engine.tactics,
                 "; batch invariant: each linear's one-row route at every row count" if options.batch_invariant else "")
        block_size = self.limits.kv_block_size
        spec = engine.spec
        # layers of one sliding window share block tables: a window's blocks are released as it moves
        per_block = KVPool.bytes_per_block(spec, block_size, engine.model.kv_dtype, grouped=True)
        num_blocks = options.kv_cache_bytes() // per_block
        pool_bytes = num_blocks * per_block
        if pool_bytes > (available := available_memory()):
            raise ConfigError(
                f"runtime.kv_cache_memory {options.kv_cache_memory!r} is {pool_bytes / 2**30:.2f} GiB "
                f"of KV blocks, more than the {available / 2**30:.2f} GiB this machine has available; give it "
                f"less (bytes, or a fraction of available memory such as 0.5)"
            )
        self.kv = KVCacheManager(num_blocks, block_size, options.enable_prefix_reuse,
                                 KVPool.layout_for(spec, grouped=True).windows)
        needed = self.kv.peak_blocks(self.limits.max_seq_len, self.limits.max_num_tokens)
        if num_blocks < needed:
            raise ConfigError(
                f"runtime.kv_cache_memory {options.kv_cache_memory!r} holds {num_blocks} blocks of "
                f"{block_size} tokens, fewer than one max_seq_len ({self.limits.max_seq_len}) "
                f"sequence needs ({needed}, {needed * per_block} bytes); give it more memory"
            )
        self.pool = KVPool(spec, num_blocks, block_size, engine.model.kv_dtype, grouped=True)
        resident = "pages resident as first used"
        if options.kv_cache_reserve:
            started = time.perf_counter()
            self.pool.reserve()
            resident = f"reserved in {time.perf_counter() - started:.2f} s"
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s), %s", num_blocks, block_size, pool_bytes / 2**30,
                 resident, self.pool.layout.describe())
        self.scheduler = Scheduler(self.kv, self.limits.max_batch_size, self.limits.max_num_tokens,
                                   options.scheduler, options.max_prefill_share, options.prefill_per_decode,
                                   options.prefill_max_wait, options.prefill_per_decode_from)
        self.runner = ModelRunner(engine.model, self.pool)
        self._ids = itertools.count(1)
        self._lock = threading.Condition()
        self._incoming: deque[Sequence] = deque()
        self._cancelled: set[int] = set()
        self._live: dict[int, Sequence] = {}  # enqueued and not finished (executor thread's view)
        self._responses: dict[int, deque[Response]] = {}
        self._held: dict[int, Response] = {}  # tokens under runtime.stream_interval, not yet emitted
        self._queued = 0  # requests not yet running
        self._stopped = False
        self._counters = {"steps": 0, "tokens_computed": 0, "tokens_generated": 0, "requests_finished": 0}
        self._step_log = None  # opened last: nothing after it can fail the load
        if options.step_log:
            try:  # line-buffered: each step's line is in the file once the step is done
                self._step_log = open(options.step_log, "a", buffering=1, encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"runtime.step_log {options.step_log!r} cannot be opened for appending: "
                                  f"{exc.strerror or exc}") from None

    # --- the API -----------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if a request can never be served by this engine."""
        limits = self.limits
        if not prompt_ids:
            raise RequestError("the prompt is empty (0 tokens)")
        if len(prompt_ids) > limits.max_input_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens, over this engine's "
                               f"max_input_len {limits.max_input_len}")
        if len(prompt_ids) + params.max_tokens > limits.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt_ids) + params.max_tokens}, over this engine's max_seq_len {limits.max_seq_len}")
        vocab = self.engine.spec.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        for what, words in (("stop_words", params.stop_words), ("bad_words", params.bad_words)):
            outside = [t for word in words for t in word if not 0 <= t < vocab]
            if outside:
                raise RequestError(f"{what} token ids {outside[:5]} are outside the vocabulary [0, {vocab})")
        if params.end_id is not None and params.end_id >= vocab:
            raise RequestError(f"end_id {params.end_id} is outside the vocabulary [0, {vocab}) "
                               "(a negative end_id means: never end early)")
        if params.embedding_bias is not None and len(params.embedding_bias) != vocab:
            raise RequestError(f"embedding_bias has {len(params.embedding_bias)} values; the vocabulary has {vocab}")

    def enqueue(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; its responses come from await_responses. A request this engine can
        never serve raises RequestError here (nothing is queued); one refused because the queue
        is full gets a final error response ("busy: ...") instead, as a later retry may succeed."""
        self.check(prompt_ids, params)
        request_id = next(self._ids)
        with self._lock:
            self._responses[request_id] = deque()
            if self._queued >= self.options.max_queue_size:
                error = (f"busy: {self._queued} requests are queued (max_queue_size "
                         f"{self.options.max_queue_size}); retry later")
                self._emit(Response(request_id, [], True, FINISH_ERROR, error, busy=True))
                return request_id
            seq = Sequence(request_id, list(prompt_ids), params, self._stop_ids(params))
            if self.options.request_timeout:
                seq.deadline = time.monotonic() + self.options.request_timeout
            self._incoming.append(seq)
            self._queued += 1
            self._lock.notify_all()
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify_all()

    def await_responses(self, request_id: int | None = None, timeout: float | None = None) -> list[Response]:
        """Responses ready for one request (or for all); waits up to `timeout` for the first.
        A request's queue is dropped after its final response is taken."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if request_id is None:
                    ready = [rid for rid, q in self._responses.items() if q]
                else:
                    if request_id not in self._responses:
                        raise KeyError(f"unknown or already finished request {request_id}")
                    ready = [request_id] if self._responses[request_id] else []
                if ready:
                    out = []
                    for rid in ready:
                        queue = self._responses[rid]
                        out += queue
                        queue.clear()
                        if out[-1].finished:
                            del self._responses[rid]
                    return out
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return []
                self._lock.wait(remaining)

    def stats(self) -> dict:
        with self._lock:
            running = list(self.scheduler.running)
            return {**self.kv.stats(), **self._counters, "running": len(running),
                    "tokens_cached": sum(s.num_computed for s in running), "queued": self._queued,
                    "preemptions": self.scheduler.num_preemptions,
                    "kv_bytes_per_token": self.pool.bytes_per_token}

    def reset_peak_stats(self) -> None:
        """Start a new high-water mark for blocks_used_peak (e.g. per benchmark level)."""
        with self._lock:
            self.kv.reset_peak()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._thread.join()
        if self._step_log is not None:
            with contextlib.suppress(OSError):  # its last lines could not be written: steps were warned of
                self._step_log.close()

    # --- the loop ----------------------------------------------------------------------
    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        if params.ignore_eos or (params.end_id is not None and params.end_id < 0):
            return frozenset()  # TensorRT-LLM's convention: end_id -1 never ends
        if params.end_id is not None:
            return frozenset({params.end_id})
        return frozenset(self.engine.spec.eos_ids)

    def _emit(self, response: Response) -> None:  # with the lock held
        self._responses[response.request_id].append(response)
        self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopped or self._incoming or self._cancelled or self.scheduler.has_work()):
                    self._lock.wait()
                if self._stopped:
                    return
                for seq in self._incoming:
                    self.scheduler.add(seq)
                    self._live[seq.request_id] = seq
                self._incoming.clear()
                cancelled, self._cancelled = self._cancelled, set()
                for request_id in cancelled:
                    seq = self._live.get(request_id)
                    if seq is not None:
                        self._finish(seq, FINISH_CANCELLED)
                expired = self._expire()
                if cancelled or expired:  # they may have been waiting: no step may follow to recount
                    self._queued = len(self._incoming) + len(self.scheduler.waiting)
            try:
                self.step()
            except Exception as exc:  # keep serving: fail what was in flight, not the server
                log.exception("engine step failed")
                with self._lock:
                    for seq in list(self._live.values()):
                        self._finish(seq, FINISH_ERROR, f"internal error in the engine step: {exc}")

    def _expire(self) -> bool:  # with the lock held
        """End the requests live past their deadline (runtime.request_timeout): a client that went
        away unnoticed (Triton does not pass an ensemble client's cancellation on) holds its
        KV blocks and batch slot that long at most."""
        if not self.options.request_timeout:
            return False
        now = time.monotonic()
        expired = [seq for seq in self._live.values() if seq.deadline is not None and now >= seq.deadline]
        for seq in expired:
            log.warning("request %d timed out after %.1f s (runtime.request_timeout) with %d tokens generated",
                        seq.request_id, self.options.request_timeout, seq.num_generated)
            self._finish(seq, FINISH_TIMEOUT)
        return bool(expired)

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            return
        with self._lock:
            self._queued = len(self._incoming) + len(self.scheduler.waiting)
        tokens = sum(count for _, count in batch)
        logged = self._step_log is not None
        decode_tokens = sum(count for seq, count in batch if count == 1 and seq.num_generated > 0) if logged else 0
        started = time.perf_counter()
        sampled = self.runner.run(batch)
        ms = (time.perf_counter() - started) * 1000
        with self._lock:
            self._counters["steps"] += 1
            self._counters["tokens_computed"] += tokens
            for seq, count in batch:
                seq.num_computed += count
                self.kv.register_full_blocks(seq)
                if self.kv.releases_behind_window:
                    self.kv.release_behind_window(seq)
            for sample in sampled:
                self._on_token(sample)
            line = None if not logged else dict(zip(names.STEP_LOG_FIELDS, (
                round(time.time(), 6), self._counters["steps"], round(ms, 3), len(batch), tokens, decode_tokens,
                self._queued, self.kv.num_used_blocks)))
        if line is not None:
            self._write_step_log(line)

    def _write_step_log(self, line: dict) -> None:
        """Outside the lock. A log that cannot be written is closed with a warning; the requests go on."""
        try:
            self._step_log.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as exc:
            log.warning("runtime.step_log %r: %s; no more steps are logged", self.options.step_log, exc)
            log_file, self._step_log = self._step_log, None
            with contextlib.suppress(OSError):
                log_file.close()

    def _on_token(self, sample: Sample) -> None:  # with the lock held
        seq, token = sample.seq, sample.token
        if sample.error is not None:
            self._finish(seq, FINISH_ERROR, sample.error)
            return
        response = Response(seq.request_id, [])
        if seq.num_generated == 0 and seq.context_logits is not None:
            response.context_logits, seq.context_logits = seq.context_logits, None
        if token in seq.stop_ids:  # the end id itself is not part of the output
            self._finish(seq, FINISH_STOP, response=response)
            return
        seq.token_ids.append(token)
        response.token_ids.append(token)
        if sample.log_prob is not None:
            response.log_probs.append(sample.log_prob)
        if sample.logits is not None:
            response.generation_logits.append(sample.logits)
        self._counters["tokens_generated"] += 1
        if ends_with_stop_word(seq.token_ids, seq.params):  # the stop word is kept
            self._finish(seq, FINISH_STOP, response=response)
        elif seq.num_generated == seq.params.max_tokens:
            self._finish(seq, FINISH_LENGTH, response=response)
        else:
            self._emit_tokens(seq, response)

    def _emit_tokens(self, seq: Sequence, response: Response) -> None:  # with the lock held
        """A response of generated tokens that does not end its request: the first token goes out at
        once, later ones when runtime.stream_interval of them are held (a response each, not one a
        token: less for every stream's consumer to send and decode)."""
        response = self._with_held(seq, response)
        if seq.num_generated == 1 or len(response.token_ids) >= self.options.stream_interval:
            self._emit(response)
        else:
            self._held[seq.request_id] = response

    def _with_held(self, seq: Sequence, response: Response) -> Response:  # with the lock held
        """The tokens held back for seq (runtime.stream_interval), if any, followed by response's"""
        held = self._held.pop(seq.request_id, None)
        return response if held is None else held.extend(response)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, response: Response | None = None) -> None:
        self.scheduler.finish(seq, reason)
        del self._live[seq.request_id]
        self._counters["requests_finished"] += 1
        # tokens held back go out with the end
        response = self._with_held(seq, response or Response(seq.request_id, []))
        response.finished, response.finish_reason, response.error = True, reason, error
        self._emit(response)
