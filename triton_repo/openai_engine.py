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


class EngineCall:
    """One streaming call of the engine model; `cancel()` ends it (the engine model sees the
    cancellation and frees the request). Iterating yields Chunks until the engine is done."""

    def __init__(self, client, served: ServedModel, request: EngineRequest):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import np_to_triton_dtype

        self.served = served
        tensors = []
        for name, array in request.tensors().items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)

        async def one_request():
            yield {"model_name": served.engine_model, "inputs": tensors, "request_id": uuid.uuid4().hex,
                   "parameters": {names.CODED_ERRORS_PARAMETER: True}}

        self._responses = client.stream_infer(one_request())
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._responses.cancel()

    async def chunks(self) -> AsyncIterator[Chunk]:
        import grpc

        try:
            async for result, error in self._responses:
                if error is not None:
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
        except asyncio.CancelledError:  # grpc's answer to reading a call cancel() ended
            if not self.cancelled or asyncio.current_task().cancelling():
                raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self.cancelled:
                return
            raise OpenAIError(503, f"the Triton server does not answer: {exc.details()}") from None
