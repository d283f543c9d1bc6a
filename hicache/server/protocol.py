"""The OpenAI wire format at the HTTP edge: request models (pydantic), error objects, response bodies.

Unknown fields are ignored, as OpenAI does; known fields with the wrong type fail validation (400).
hicache extensions: `ignore_eos`, `top_k`, `stop_token_ids` in requests; in `usage.prompt_tokens_details`
`cached_tokens_per_tier` ({"device", "host", "disk"}: prompt tokens served from each tier).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hicache.engine.request import TIER_NAMES, Usage


class APIError(Exception):
    """An error answered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """{"error": {...}} as OpenAI sends it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints (OpenAI's plus vLLM/SGLang's usual extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt as text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI usage with cached_tokens, plus hicache's per-tier split."""
    per_tier = {t: usage.cached_tokens.get(t, 0) for t in TIER_NAMES}
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(per_tier.values()), "cached_tokens_per_tier": per_tier},
    }


def completion_body(request_id: str, model: str, created: int, text: str, reason: str | None,
                    usage: Usage | None, chunk: bool = False) -> dict[str, Any]:
    """A text_completion object (or one streamed chunk of it)."""
    body: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    elif not chunk:
        body["usage"] = None
    return body


def chat_body(request_id: str, model: str, created: int, text: str, reason: str | None,
              usage: Usage | None) -> dict[str, Any]:
    """A chat.completion object."""
    message = {"role": "assistant", "content": text}
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        "usage": usage_body(usage) if usage is not None else None,
    }


def chat_chunk(request_id: str, model: str, created: int, delta: dict[str, Any], reason: str | None) -> dict:
    """One chat.completion.chunk with a single choice."""
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
    }


def usage_chunk(request_id: str, model: str, created: int, usage: Usage, chat: bool) -> dict[str, Any]:
    """The final chunk of stream_options.include_usage: no choices, the usage."""
    return {
        "id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
        "model": model, "choices": [], "usage": usage_body(usage),
    }


def now() -> int:
    return int(time.time())

