"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions, and what
each request asks of the engine. Pure data (pydantic), so it is tested without a server.

Fields the engine honours are mapped to its inputs; fields that would change the answer but that
kiln cannot honour (n > 1, best_of, echo, suffix, tools, JSON response formats, more than the
chosen token's log probability) are refused with a 400 naming them, never ignored. Fields that
do not change the answer (user, metadata, store, service_tier) are accepted and ignored."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# OpenAI's error types by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
               500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> OpenAIError:
    """pydantic's first complaint as a 400 naming the field and the value."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body") or None
    if first["type"] == "missing":
        return OpenAIError(400, f"{where} is required", param=where)
    shown = repr(first.get("input"))
    if isinstance(first.get("input"), dict) and len(shown) >= 120:
        shown = "{...}"
    return OpenAIError(400, f"{where or 'request'}: {first['msg']} (got {shown})", param=where)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """The sampling fields both endpoints share (OpenAI's defaults), and kiln's extensions
    (top_k, repetition_penalty, min_tokens: what vLLM and TensorRT-LLM's clients also send)."""
    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = 1
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        for key, weight in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100.0 <= weight <= 100.0:
                raise ValueError(f"bias {weight} for token {key} is not within [-100, 100]")
        return value

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise OpenAIError(400, f"n={self.n}: kiln returns one choice per request; send the request "
                                   "n times with different seeds", param="n")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream: true", param="stream_options")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if isinstance(self.prompt, list) and (len(self.prompt) != 1 and not all(isinstance(p, int) for p in self.prompt)):
            raise OpenAIError(400, f"prompt holds {len(self.prompt)} prompts: kiln answers one prompt per "
                                   "request; send them as separate (concurrent) requests", param="prompt")
        if self.best_of not in (None, 1):
            raise OpenAIError(400, f"best_of={self.best_of} is not supported (only 1)", param="best_of")
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise OpenAIError(400, "suffix (fill in the middle) is not supported", param="suffix")
        if self.logprobs is not None and self.logprobs > 1:
            raise OpenAIError(400, f"logprobs={self.logprobs}: kiln returns the chosen token's log "
                                   "probability only (logprobs 0 or 1)", param="logprobs")

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt, list) and not prompt:
            raise OpenAIError(400, "prompt holds no tokens", param="prompt")
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read more (name, reasoning_content)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates read it: content as one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise OpenAIError(400, f"message content of type {part.type!r} is not supported (text only)",
                                      param="messages")
                texts.append(part.text)
            message["content"] = "".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise OpenAIError(400, "tools (function calling) are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise OpenAIError(400, f"response_format {self.response_format.get('type')!r} is not supported "
                                   "(text only)", param="response_format")
        if self.top_logprobs and self.top_logprobs > 1:
            raise OpenAIError(400, f"top_logprobs={self.top_logprobs}: kiln returns the chosen token's log "
                                   "probability only (top_logprobs 0 or 1)", param="top_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise OpenAIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                   f"({self.max_completion_tokens}) disagree", param="max_completion_tokens")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tokens: list[str], log_probs: list[float], offset: int, top: bool) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": log_probs,
            "top_logprobs": [{t: p} for t, p in zip(tokens, log_probs)] if top else None,
            "text_offset": offsets}


def chat_logprobs(tokens: list[str], token_bytes: list[bytes], log_probs: list[float], top: bool) -> dict:
    content = []
    for token, raw, logprob in zip(tokens, token_bytes, log_probs):
        entry = {"token": token, "logprob": logprob, "bytes": list(raw)}
        entry["top_logprobs"] = [dict(entry)] if top else []
        content.append(entry)
    return {"content": content}
