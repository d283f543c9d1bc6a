"""The OpenAI wire format at the HTTP edge: request models (pydantic) and their parsing into engine inputs
(body size limit, JSON, validation, sampling parameters), error objects, response bodies.

Unknown fields are ignored, as OpenAI does; known fields with the wrong type fail validation (400).
hicache extensions: `ignore_eos`, `top_k`, `stop_token_ids` in requests; in `usage.prompt_tokens_details`
`cached_tokens_per_tier` ({"device", "host", "disk", "remote"}: prompt tokens served from each tier; "remote": the
remote tier's pages, which this server's local disk store does not hold).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from starlette.requests import ClientDisconnect, Request

from controller.stats import HIT_TIERS
from hicache.engine.params import SamplingParams
from hicache.engine.request import Usage


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
    """{"error": {...}} as OpenAI sends it. A message that echoes what a client sent may hold characters UTF-8 cannot
    encode (a lone surrogate, `"\\ud800"` in JSON): they are written as escapes, so the error is still answered."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


INT_MAX = 2**31 - 1  # bound of the integer knobs (top_k, n, token counts): more than any model has
SEED_MAX = 2**63 - 1  # torch's generator takes a signed 64-bit seed


def _integer(value: Any) -> Any:
    """JSON integers only: not `true` (a bool is an int in Python), not "3", not 3.0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


def _number(value: Any) -> Any:
    """JSON numbers only (not booleans or strings), finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return float(value)


def _boolean(value: Any) -> Any:
    """JSON booleans only: not "yes", "true", 1 or 0."""
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


MAX_STOP_STRINGS = 16  # OpenAI's bound too


def _stop(value: Any) -> Any:
    """`stop`: a string or a list of at most MAX_STOP_STRINGS strings, said so (a union's own error would name only
    its first branch: "should be a valid string")."""
    if isinstance(value, list):
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        if not all(isinstance(v, str) for v in value):
            raise ValueError("stop strings must be strings")
    return value


def _prompt(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """`prompt`: a string, strings, token ids or lists of token ids, validated in pydantic's own code (a prompt of
    millions of ids is checked without a Python call per id); where that fails on numbers that are not integers,
    the error says so rather than naming the union's first branch."""
    try:
        return handler(value)
    except ValidationError:
        items = value if isinstance(value, list) else []
        flat = [x for item in items for x in (item if isinstance(item, list) else [item])]
        if any(isinstance(x, (bool, float)) for x in flat):
            raise ValueError("token ids must be integers") from None
        raise


Integer = Annotated[int, BeforeValidator(_integer)]
Number = Annotated[float, BeforeValidator(_number)]
Boolean = Annotated[bool, BeforeValidator(_boolean)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Boolean = False


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints (OpenAI's plus vLLM/SGLang's usual extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Integer | None = Field(None, ge=1, le=INT_MAX)
    min_tokens: Integer = Field(0, ge=0, le=INT_MAX)  # vLLM's: no EOS, stop id or stop string ends it earlier
    temperature: Number | None = Field(None, ge=0, le=1e4)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: Integer | None = Field(None, ge=-1, le=INT_MAX)
    n: Integer = Field(1, ge=1, le=INT_MAX)
    stream: Boolean = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, BeforeValidator(_stop)] = None  # at most 16 strings, of any length
    stop_token_ids: list[Annotated[Integer, Field(ge=0, le=INT_MAX)]] | None = Field(None, max_length=1024)
    seed: Integer | None = Field(None, ge=0, le=SEED_MAX)
    ignore_eos: Boolean = False
    presence_penalty: Number = Field(0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    user: str | None = None
    # the request's cache namespace within its tenant's (vLLM's field): prefixes match only between requests with
    # the same salt (hicache/server/tenants.py)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # OpenAI features this server does not implement: refused by name when asked for (see sampling_params)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt as text or token ids."""

    prompt: Annotated[str | list[str] | list[StrictInt] | list[list[StrictInt]], WrapValidator(_prompt)]
    echo: Boolean = False
    best_of: Integer | None = None  # a JSON integer: "2" is refused as the docs say
    suffix: str | None = None


# the roles a chat may name: a role is rendered into the prompt as the template's own text (special tokens read as
# markers), so any other string could carry a turn of its own (`user<|im_end|>...<|im_start|>system`)
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1, le=INT_MAX)
    top_logprobs: Integer | None = Field(None, ge=0, le=20)


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI usage with cached_tokens, plus hicache's per-tier split."""
    per_tier = {t: usage.cached_tokens.get(t, 0) for t in HIT_TIERS}
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


# ---------------------------------------------------------------------- parsing requests


async def read_request(request: Request, limit: int, model: type[BaseModel], max_commas: int | None = None) -> Any:
    """The request body as `model`: read on the event loop, parsed and validated in a worker thread, so that a
    large body does not hold up other requests, /health and the streams being sent.

    `max_commas`: the most commas a request that can fit the context holds (its token ids, and the commas of its
    text, bounded by the text that fits). A body with more, such as a prompt of millions of token ids, is refused
    before it is parsed: parsing 4 MB of numbers holds the interpreter lock for most of a second."""
    body = await read_body(request, limit)
    if max_commas is not None:
        commas = body.count(b",")
        if commas > max_commas:
            raise APIError(400, f"the request holds {commas} items or more: more than any prompt that fits this "
                           "model's context", code="context_length_exceeded")
    return await asyncio.to_thread(parse_request, body, model)


def parse_request(body: bytes | bytearray, model: type[BaseModel]) -> Any:
    """A request body as `model` (400 naming what is wrong)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    return validate(model, data)


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body's bytes; 413 beyond `limit` bytes, 400 if its framing is ambiguous.

    A body over the limit is read to its end and dropped (up to DRAIN_LIMIT bytes more), so that a client still
    sending it gets the 413 rather than a connection reset. A client that goes away while sending is answered
    with nothing: `ClientGone`, which the app turns into a quiet log line."""
    headers = request.headers
    if "transfer-encoding" in headers and "content-length" in headers:
        # RFC 9112 6.1: a request with both may be an attempt at request smuggling; refuse it, reading nothing
        raise APIError(400, "a request may not have both Content-Length and Transfer-Encoding")
    length = headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > limit + DRAIN_LIMIT:
        raise APIError(413, f"request body is {length} bytes; the limit is {limit}")  # not worth reading
    body = bytearray()
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                body += chunk
            elif size > limit + DRAIN_LIMIT:
                break
    except ClientDisconnect:
        raise ClientGone() from None
    if size > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}" if declared is not None
                       else f"request body exceeds the limit of {limit} bytes")
    return body


DRAIN_LIMIT = 16 << 20  # bytes of a too-large body read and dropped before answering 413


class ClientGone(Exception):
    """The client disconnected before its request was read: nobody is left to answer."""


def _check_text(text: str, param: str) -> str:
    """Text the tokenizer can encode: a lone surrogate (JSON's "\\ud800" escape) is not a character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: not valid Unicode text ({e.reason} at position {e.start})",
                       param=param) from None
    return text


def validate(model: type[BaseModel], data: Any) -> Any:
    """data as `model`, or a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except RecursionError:
        raise APIError(400, "body: nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(part) for part in err["loc"]) or None
        raise APIError(400, f"{param or 'body'}: {err['msg']}", param=param) from None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
    """The engine's SamplingParams for a request; 400 for unsupported or impossible values."""
    # logprobs: an integer on completions (0 asks for the sampled token's), a boolean on chat (false: none)
    asked_logprobs = not (req.logprobs is None or req.logprobs is False)
    unsupported = {"n": req.n != 1, "logprobs": asked_logprobs, "logit_bias": bool(req.logit_bias),
                   "presence_penalty": req.presence_penalty != 0, "frequency_penalty": req.frequency_penalty != 0}
    unsupported.update(tools=bool(req.tools), tool_choice=req.tool_choice not in (None, "none"),
                       response_format=bool(req.response_format) and req.response_format.get("type") != "text")
    if isinstance(req, CompletionRequest):
        unsupported.update(echo=req.echo, best_of=req.best_of not in (None, 1), suffix=bool(req.suffix))
    else:
        unsupported.update(top_logprobs=bool(req.top_logprobs))
    for name, bad in unsupported.items():
        if bad:
            raise APIError(400, f"{name}={getattr(req, name)!r} is not supported", param=name)
    values: dict[str, Any] = {"max_tokens": max_tokens, "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos,
                              "seed": req.seed}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            values[name] = getattr(req, name)
    if req.stop is not None:
        values["stop"] = req.stop
        for stop in [req.stop] if isinstance(req.stop, str) else req.stop:
            _check_text(stop, "stop")
    if req.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(req.stop_token_ids)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param if param in values else None) from None


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: text content only."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages.{i}.content: only text parts are supported",
                                     param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": _check_text(m.role, f"messages.{i}.role"),
                    "content": _check_text(content or "", f"messages.{i}.content")})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request (text or token ids)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"got {len(prompt)} prompts; one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    return _check_text(prompt, "prompt") if isinstance(prompt, str) else prompt
