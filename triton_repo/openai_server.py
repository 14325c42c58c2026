"""An OpenAI-compatible HTTP frontend (FastAPI) for a served kiln repository: GET /v1/models,
POST /v1/completions and /v1/chat/completions, streamed (server-sent events ending with
`data: [DONE]`) or not. It forwards each request to the repository's engine model over Triton
gRPC streaming (openai_engine.py); a client that goes away cancels its engine request."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.triton_repo.chat_template import ChatTemplateError
from kiln.triton_repo.openai_engine import Chunk, EngineCall, EngineRequest, ServedModel
from kiln.triton_repo.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_logprobs,
                                              completion_id, completion_logprobs, now, usage, validation_error)

DONE = "data: [DONE]\n\n"


class StopText:
    """OpenAI's stop sequences on the text: the text before the first one is returned, and a
    tail that could still become one is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def _could_start_a_stop(self) -> int:
        """The length of the longest tail of the pending text that begins some stop sequence."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for size in range(min(longest, len(self.pending)), 0, -1):
            tail = self.pending[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop sequence was found)."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[:min(found)], ""
            return out, True
        cut = len(self.pending) - self._could_start_a_stop()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """One request's run through the engine: text pieces as they can be sent, then why it ended.
    prompt_tokens / completion_tokens / token_ids / log_probs grow as it runs."""

    def __init__(self, call: EngineCall, prompt_tokens: int, max_tokens: int, stops: list[str]):
        self.call, self.max_tokens = call, max_tokens
        self.stop = StopText(stops)
        self.prompt_tokens = prompt_tokens
        self.token_ids: list[int] = []
        self.log_probs: list[float] = []
        self.finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    async def pieces(self) -> AsyncIterator[tuple[str, Chunk]]:
        stopped = ended = False
        try:
            async for chunk in self.call.chunks():
                if stopped:  # what the engine made before it took the stop: not part of the answer
                    continue
                self.token_ids += chunk.token_ids
                self.log_probs += chunk.log_probs
                text, stopped = self.stop.feed(chunk.text)
                if stopped:  # a stop sequence: the engine ends the request, its call ends as calls do
                    self.call.stop()
                yield text, chunk
            ended = True
        finally:
            if not ended:  # an error, a client gone: nobody reads the call to its end
                self.call.abandon()
        if not stopped:
            rest = self.stop.flush()
            if rest:
                yield rest, Chunk([], rest, [])
        length = not stopped and self.completion_tokens >= self.max_tokens
        self.finish_reason = "length" if length else "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _logprob_options(body, chat: bool) -> tuple[bool, bool]:
    """(log probabilities wanted, with top_logprobs entries): chat's logprobs / top_logprobs,
    completions' logprobs 0 or 1."""
    if chat:
        return body.logprobs, bool(body.top_logprobs)
    return body.logprobs is not None, bool(body.logprobs)


async def _wait_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Frontend:
    """The endpoints, over one ServedModel and one Triton gRPC client (made in the server's loop)."""

    def __init__(self, served: ServedModel, url: str):
        self.served, self.url = served, url
        self.client = None

    async def open(self):
        import tritonclient.grpc.aio as grpcaio

        self.client = grpcaio.InferenceServerClient(self.url)

    async def close(self):
        if self.client is not None:
            await self.client.close()

    # --- requests --------------------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name != self.served.name:
            raise OpenAIError(404, f"The model {name!r} does not exist: this server serves {self.served.name!r}",
                              param="model", code="model_not_found")

    def _engine_request(self, body, prompt_ids: list[int], log_probs: bool) -> EngineRequest:
        served = self.served
        bad = [t for t in prompt_ids if not 0 <= t < served.vocab_size]
        if bad:
            raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {served.vocab_size})",
                              param="prompt")
        asked = body.output_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
        bias = None
        if body.logit_bias:
            bias = np.zeros(served.vocab_size, dtype=np.float32)
            for key, weight in body.logit_bias.items():
                if int(key) >= served.vocab_size:
                    raise OpenAIError(400, f"logit_bias token id {key} is outside the vocabulary "
                                           f"[0, {served.vocab_size})", param="logit_bias")
                bias[int(key)] = weight
        stop_words = [ids for ids in (served.encode(s, special_tokens=False) for s in body.stop) if ids]
        return EngineRequest(
            prompt_ids=prompt_ids, max_tokens=served.output_limit(len(prompt_ids), asked),
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
            stop_words=stop_words or None, embedding_bias=bias, log_probs=log_probs)

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt_input()
        return list(prompt) if isinstance(prompt, list) else self.served.encode(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        template = self.served.chat_template
        if template is None:
            raise OpenAIError(400, f"the model {self.served.name!r} has no chat template (its checkpoint carried "
                                   "none): use /v1/completions with your own prompt format", param="messages")
        messages = [message.as_template_input() for message in body.messages]
        try:
            text = template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        return self.served.encode(text, special_tokens=False)  # the template wrote any BOS itself

    async def start(self, request, body, chat: bool):
        """Parse, check and send a request; the Generation, its first piece (so engine errors
        such as a full queue are answered with their status before any byte of a stream)."""
        body.refuse_unsupported()
        self._check_model(body.model)
        log_probs = _logprob_options(body, chat)[0]
        prompt_ids = self.chat_prompt(body) if chat else self.completion_prompt(body)
        engine_request = self._engine_request(body, prompt_ids, log_probs)
        call = EngineCall(self.client, self.served, engine_request)
        generation = Generation(call, len(prompt_ids), engine_request.max_tokens, body.stop)
        pieces = generation.pieces()
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        disconnect.add_done_callback(lambda task: task.cancelled() or call.stop())
        try:
            first = await anext(pieces, None)
        except BaseException:
            disconnect.cancel()
            raise
        return generation, pieces, first, disconnect

    # --- responses ---------------------------------------------------------------------
    def _logprobs(self, generation: Generation, start: int, end: int, chat: bool, top: bool, offset: int = 0):
        ids = generation.token_ids[start:end]
        tokens = [self.served.token_text(t) for t in ids]
        values = generation.log_probs[start:end]
        if chat:
            return chat_logprobs(tokens, [self.served.token_raw(t) for t in ids], values, top)
        return completion_logprobs(tokens, values, offset, top)

    async def complete(self, request, body, chat: bool) -> dict:
        generation, pieces, first, disconnect = await self.start(request, body, chat)
        try:
            texts = [] if first is None else [first[0]]
            async for text, _ in pieces:
                texts.append(text)
        finally:
            disconnect.cancel()
        text = "".join(texts)
        wants, top = _logprob_options(body, chat)
        logprobs = self._logprobs(generation, 0, len(generation.token_ids), chat, top) if wants else None
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": generation.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": completion_id(chat), "object": "chat.completion" if chat else "text_completion",
                "created": now(), "model": self.served.name, "choices": [choice],
                "usage": usage(generation.prompt_tokens, generation.completion_tokens)}

    async def stream(self, generation: Generation, pieces, first, disconnect, body, chat: bool):
        """Server-sent events: a chunk per piece, the finish reason, usage if asked, [DONE]."""
        ident, created, model = completion_id(chat), now(), self.served.name
        kind = "chat.completion.chunk" if chat else "text_completion"
        wants, top = _logprob_options(body, chat)
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def event(text: str | None, finish: str | None, role: bool = False, logprobs=None) -> str:
            choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice["delta"] = delta
            else:
                choice["text"] = text or ""
            payload = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        sent_tokens, offset = 0, 0
        try:
            if chat:
                yield event(None, None, role=True)

            async def all_pieces():
                if first is not None:
                    yield first
                async for piece in pieces:
                    yield piece

            async for text, _ in all_pieces():
                logprobs = None
                if wants:
                    end = len(generation.token_ids)
                    logprobs = self._logprobs(generation, sent_tokens, end, chat, top, offset)
                    sent_tokens = end
                if text or logprobs:
                    yield event(text, None, logprobs=logprobs)
                offset += len(text)
            yield event(None if chat else "", generation.finish_reason)
            if include_usage:
                yield _sse({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": usage(generation.prompt_tokens, generation.completion_tokens)})
        except OpenAIError as exc:  # after the stream began: its error as the last event
            yield _sse(exc.body())
        finally:
            disconnect.cancel()
            if generation.finish_reason is None:
                generation.call.abandon()
        yield DONE


def create_app(served: ServedModel, url: str):
    """The FastAPI application serving `served` through the Triton server at gRPC `url`."""
    frontend = Frontend(served, url)

    @asynccontextmanager
    async def lifespan(app):
        await frontend.open()
        yield
        await frontend.close()

    app = FastAPI(title="kiln OpenAI-compatible API", lifespan=lifespan)
    app.state.frontend = frontend

    @app.exception_handler(OpenAIError)
    async def openai_error(request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, exc: RequestValidationError):
        return JSONResponse(OpenAIError(400, f"invalid request: {exc.errors()[0]['msg']}").body(), status_code=400)

    async def parse(request: Request, model):
        try:
            data = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(served)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        frontend._check_model(name)
        return model_card(served)

    @app.get("/health")
    async def health():
        try:
            ready = await frontend.client.is_model_ready(served.engine_model)
        except Exception as exc:  # tritonclient raises its own exception type
            raise OpenAIError(503, f"the Triton server does not answer: {exc}") from None
        if not ready:
            raise OpenAIError(503, f"the engine model {served.engine_model!r} is not ready")
        return {"status": "ok"}

    async def endpoint(request: Request, chat: bool):
        body = await parse(request, ChatCompletionRequest if chat else CompletionRequest)
        if not body.stream:
            return await frontend.complete(request, body, chat)
        started = await frontend.start(request, body, chat)
        return StreamingResponse(frontend.stream(*started, body, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)

    return app


def model_card(served: ServedModel) -> dict:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "kiln",
            "max_model_len": served.max_seq_len}


class OpenAIServer:
    """The frontend on host:port, in a thread of this process (uvicorn); start() returns once it
    listens, stop() ends it."""

    def __init__(self, served: ServedModel, url: str, host: str = "127.0.0.1", port: int = 9000,
                 log_level: str = "warning"):
        import uvicorn

        self.host, self.port = host, port
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.socket = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise KilnError(f"the OpenAI frontend cannot listen on {host}:{port}: {exc.strerror}") from None
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(create_app(served, url), log_level=log_level, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="kiln-openai", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        self.thread.start()
        for _ in range(int(timeout / 0.05)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            time.sleep(0.05)
        self.stop()
        raise KilnError(f"the OpenAI frontend on {self.host}:{self.port} did not start")

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)
        self.socket.close()
