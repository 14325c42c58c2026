"""The OpenAI frontend's side of the served repository: what it knows of the engine (tokenizer,
chat template, limits), and its requests to the engine model over Triton gRPC streaming.

The frontend tokenizes and detokenizes itself, as trtllm-serve does, and calls the repository's
engine model directly (not the ensemble): it gets the token ids (usage counts, log probabilities
with their tokens), and a cancelled call reaches the engine model, which frees the request's KV
blocks at once (Triton 2.51 does not pass an ensemble client's cancellation on)."""
from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln import constants as names
from kiln.errors import KilnError
from kiln.runtime.detokenizer import TokenBytes, decode_delta
from kiln.triton_repo.chat_template import ChatTemplate
from kiln.triton_repo.engine_calls import STOP_GRACE_S, grpc_inputs, stop_inputs
from kiln.triton_repo.model_utils import split_coded
from kiln.triton_repo.openai_protocol import OpenAIError

# the engine model's error codes (coded error messages) -> HTTP status
HTTP_STATUS = {"INVALID_ARG": 400, "NOT_FOUND": 404, "UNSUPPORTED": 400, "UNAVAILABLE": 503, "CANCELLED": 499}
_ENGINE_DIR = re.compile(r'key:\s*"' + names.ENGINE_DIR_PARAMETER + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


@dataclass(frozen=True)
class ServedModel:
    """The engine behind a repository, as the frontend needs it."""
    name: str  # the id OpenAI clients send as `model`
    engine_model: str  # the Triton model that runs the engine
    engine_dir: Path
    tokenizer: object  # tokenizers.Tokenizer
    token_bytes: TokenBytes | None
    chat_template: ChatTemplate | None
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    created: int

    @classmethod
    def from_repo(cls, repo: str | Path, name: str | None = None) -> "ServedModel":
        """The repository's engine model is the one whose config.pbtxt names an engine_dir."""
        from tokenizers import Tokenizer

        repo = Path(repo).resolve()
        found = []
        for config in sorted(repo.glob("*/config.pbtxt")):
            match = _ENGINE_DIR.search(config.read_text())
            if match:
                found.append((config.parent.name, (repo / match.group(1)).resolve()))
        if len(found) != 1:
            raise KilnError(f"{repo} is not a kiln Triton repository: expected one model with an "
                            f"{names.ENGINE_DIR_PARAMETER!r} parameter, found {len(found)}")
        engine_model, engine_dir = found[0]
        engine_json = engine_dir / names.ENGINE_JSON
        tokenizer_dir = engine_dir / names.TOKENIZER_DIR
        try:
            meta = json.loads(engine_json.read_text())
            tokenizer = Tokenizer.from_file(str(tokenizer_dir / names.TOKENIZER_JSON))
        except Exception as exc:  # OSError, bad JSON, and tokenizers' own error type
            raise KilnError(f"cannot read the engine {engine_dir} that {repo} serves: {exc}") from None
        limits = meta["limits"]
        return cls(
            name=name or engine_dir.parent.name,
            engine_model=engine_model,
            engine_dir=engine_dir,
            tokenizer=tokenizer,
            token_bytes=TokenBytes.of(tokenizer),
            chat_template=ChatTemplate.from_tokenizer_dir(tokenizer_dir),
            vocab_size=int(meta["model"]["vocab_size"]),
            max_input_len=int(limits["max_input_len"]),
            max_seq_len=int(limits["max_seq_len"]),
            created=int(engine_json.stat().st_mtime),
        )

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_raw(self, token_id: int) -> bytes:
        if self.token_bytes is not None and 0 <= token_id < len(self.token_bytes.table):
            raw = self.token_bytes.table[token_id]
            return raw or self.token_text(token_id).encode("utf-8")
        return self.token_text(token_id).encode("utf-8")

    def output_limit(self, prompt_tokens: int, asked: int | None) -> int:
        """max_tokens for the engine: what the client asked, else all the engine allows; a 400
        when the prompt, or prompt + max_tokens, is over the engine's built limits."""
        if prompt_tokens > self.max_input_len:
            raise OpenAIError(400, f"the prompt has {prompt_tokens} tokens, over this model's maximum input "
                                   f"of {self.max_input_len} tokens", param="messages", code="context_length_exceeded")
        room = self.max_seq_len - prompt_tokens
        if asked is None:
            return room
        if asked > room:
            raise OpenAIError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({asked}) = "
                                   f"{prompt_tokens + asked}, over this model's maximum context length of "
                                   f"{self.max_seq_len} tokens", param="max_tokens", code="context_length_exceeded")
        return asked


@dataclass
class EngineRequest:
    """One request for the engine model (TensorRT-LLM's tensor names)."""
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False  # generate max_tokens tokens (TensorRT-LLM's end_id -1)
    stop_words: list[list[int]] | None = None
    embedding_bias: np.ndarray | None = None  # [vocab]
    log_probs: bool = False

    def tensors(self) -> dict[str, np.ndarray]:
        from kiln.triton_repo.preprocessing import word_list_tensor

        ids = np.array(self.prompt_ids, dtype=np.int32).reshape(1, -1)
        arrays = {
            names.INPUT_IDS: ids,
            names.INPUT_LENGTHS: np.array([[ids.shape[1]]], dtype=np.int32),
            names.REQUEST_OUTPUT_LEN: np.array([[self.max_tokens]], dtype=np.int32),
            names.STREAMING: np.array([[True]]),
            names.EXCLUDE_INPUT_IN_OUTPUT: np.array([[True]]),
            names.TEMPERATURE: np.array([[self.temperature]], dtype=np.float32),
            names.RUNTIME_TOP_P: np.array([[self.top_p]], dtype=np.float32),
            names.RUNTIME_TOP_K: np.array([[self.top_k]], dtype=np.int32),
            names.PRESENCE_PENALTY: np.array([[self.presence_penalty]], dtype=np.float32),
            names.FREQUENCY_PENALTY: np.array([[self.frequency_penalty]], dtype=np.float32),
            names.REPETITION_PENALTY: np.array([[self.repetition_penalty]], dtype=np.float32),
            names.MIN_TOKENS: np.array([[self.min_tokens]], dtype=np.int32),
            names.RETURN_LOG_PROBS: np.array([[self.log_probs]]),
        }
        if self.ignore_eos:
            arrays[names.END_ID] = np.array([[-1]], dtype=np.int32)
        if self.seed is not None:
            arrays[names.SEED] = np.array([[self.seed]], dtype=np.uint64)
        if self.stop_words:
            arrays[names.STOP_WORDS_LIST] = word_list_tensor(self.stop_words)
        if self.embedding_bias is not None:
            arrays[names.EMBEDDING_BIAS] = self.embedding_bias.astype(np.float32).reshape(1, -1)
        return arrays


@dataclass
class Chunk:
    """New tokens from the engine: their ids, the text they add, their log probabilities."""
    token_ids: list[int]
    text: str
    log_probs: list[float]


_BACKGROUND: set[asyncio.Task] = set()  # tasks that outlive their request (asyncio keeps weak references)


def _in_background(coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


class EngineCall:
    """One streaming call of the engine model. Iterating `chunks()` yields Chunks until the engine
    is done. `stop()` ends the engine request as TensorRT-LLM's clients do, with a `stop` request
    for its id: the engine sends its last responses and the call ends as any call ends;
    `abandon()` also reads those itself, for when chunks() is left (an error, a client gone).
    The gRPC call is cut (`cancel()`) only where the engine has not ended the request within
    STOP_GRACE_S: Triton 2.51's gRPC frontend has races in its handling of cancelled calls that
    can take the whole server down (fixed in later releases)."""

    def __init__(self, client, served: ServedModel, request: EngineRequest):
        self.client, self.served = client, served
        self.request_id = uuid.uuid4().hex
        arrays = request.tensors()
        self._stop_arrays = stop_inputs(arrays)
        self._responses = client.stream_infer(self._one_request(arrays))
        self.cancelled = False
        self.engine_ended = False  # the engine answered with an error: the request is over
        self.stopping: asyncio.Task | None = None
        self._draining: asyncio.Task | None = None
        self.ended = asyncio.Event()  # the call was read to its end

    def _one_request(self, arrays: dict[str, np.ndarray]):
        request = {"model_name": self.served.engine_model, "inputs": grpc_inputs(arrays),
                   "request_id": self.request_id, "parameters": {names.CODED_ERRORS_PARAMETER: True}}

        async def one():
            yield request

        return one()

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._responses.cancel()

    def stop(self) -> None:
        """Ask the engine to end this request (a call of its own carries the `stop`); the engine's
        last responses still come, for chunks() to read (or abandon() to)."""
        if self.stopping is None and not (self.cancelled or self.engine_ended or self.ended.is_set()):
            self.stopping = _in_background(self._stop())

    def abandon(self) -> None:
        """Nobody reads chunks() any more (an error, a client gone): stop the request and read the
        call's last responses here, without which its status never comes."""
        self.stop()
        if self._draining is None and not self.cancelled and not self.ended.is_set():
            self._draining = _in_background(self._drain())

    async def status(self):
        """The call's gRPC status code once it has ended (OK, or CANCELLED where it was cut); for
        tests: it reads tritonclient's iterator's call (`_grpc_call`), which has no public name."""
        return await self._responses._grpc_call.code()

    async def _stop(self) -> None:
        import grpc

        try:
            async for _result, _error in self.client.stream_infer(self._one_request(self._stop_arrays)):
                pass  # an error: the request ended before the stop came
            await asyncio.wait_for(self.ended.wait(), STOP_GRACE_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError):  # the server did not take it, or not in time
            self.cancel()

    async def _drain(self) -> None:
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                async for _result, _error in self._responses:
                    pass
            self.ended.set()
        except Exception:  # the call cut, or not ended in time
            self.cancel()

    async def chunks(self) -> AsyncIterator[Chunk]:
        import grpc

        try:
            async for result, error in self._responses:
                if error is not None:
                    self.engine_ended = True
                    code, message = split_coded(error.message())
                    raise OpenAIError(HTTP_STATUS.get(code, 500), message)
                ids = result.as_numpy(names.OUTPUT_IDS)
                if ids is None or ids.size == 0:
                    continue
                token_ids = ids.reshape(-1).tolist()
                prefix = result.as_numpy(names.PREFIX_IDS)
                prefix_ids = [] if prefix is None else prefix.reshape(-1).tolist()
                log_probs = result.as_numpy(names.OUTPUT_LOG_PROBS)
                yield Chunk(token_ids, decode_delta(self.served.tokenizer, prefix_ids, token_ids),
                            [] if log_probs is None else log_probs.reshape(-1).tolist())
            self.ended.set()
        except asyncio.CancelledError:  # grpc's answer to reading a call cancel() ended
            if not self.cancelled or asyncio.current_task().cancelling():
                raise
        except grpc.aio.AioRpcError as exc:
            self.ended.set()
            if exc.code() == grpc.StatusCode.CANCELLED and self.cancelled:
                return
            raise OpenAIError(503, f"the Triton server does not answer: {exc.details()}") from None
