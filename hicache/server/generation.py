"""One generation request, from parsed body to response: tokenize, check, run on the engine, JSON or SSE.

The engine runs on its own thread (AsyncEngine); here the event loop only awaits its outputs. A client
that disconnects aborts its request (which frees its pages); every request is counted in the metrics
and, with a trace log, written to it once finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hicache.config import Config
from hicache.engine.request import StepOutput
from hicache.engine.runner import AsyncEngine
from hicache.server import protocol as p
from hicache.server.metrics import ServerMetrics
from hicache.server.tenants import Tenant, Tenants
from hicache.server.trace_log import FinishedRequest, TraceLog
from radix import CacheNamespace

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the handlers share."""

    engine: AsyncEngine
    config: Config
    model_name: str
    metrics: ServerMetrics
    trace: TraceLog | None
    tenants: Tenants
    created: int


def _text_bytes(prompt: str | list[int] | list[dict[str, Any]], chat: bool) -> int:
    """UTF-8 bytes of the text a request asks to tokenize (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    if chat:
        return sum(len((m.get("content") or "").encode("utf-8")) for m in prompt)
    return 0


async def _tokenize(state: ServerState, prompt: str | list[int] | list[dict[str, Any]], chat: bool) -> list[int]:
    """The prompt's token ids, tokenized in a worker thread. A text too long to fit the context whatever its
    tokens is refused first: tokenizing it would cost seconds of CPU for a 400."""
    tokenizer = state.engine.tokenizer
    limit = state.engine.engine.max_context
    size = _text_bytes(prompt, chat)
    # every message of a chat adds at least one token of the template's own (its turn marker), whatever its text
    turns = len(prompt) if chat else 0
    least = -(-size // tokenizer.max_token_bytes) + turns
    if least > limit:
        what = f"{size} bytes of text" + (f" in {turns} messages" if chat else "")
        raise p.APIError(400, f"this model's maximum context length is {limit} tokens; the prompt's {what} are at "
                         f"least {least} tokens", code="context_length_exceeded")

    def work() -> list[int]:
        if chat:
            try:  # message content is plain text: it cannot forge the template's markers (Tokenizer.encode_chat)
                return tokenizer.encode_chat(prompt, add_generation_prompt=True)
            except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
                raise p.APIError(400, f"messages: {e}", param="messages") from None
        return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    ids = await asyncio.to_thread(work)
    if not ids:
        raise p.APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    vocab = state.engine.engine.model.config.vocab_size
    if not chat and isinstance(prompt, list) and (min(ids) < 0 or max(ids) >= vocab):
        raise p.APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return ids


def _check_context(state: ServerState, prompt_len: int, max_tokens: int | None) -> None:
    limit = state.engine.engine.max_context
    if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
        wanted = f"{prompt_len} in the prompt" + (f" + {max_tokens} to generate" if max_tokens else "")
        raise p.APIError(400, f"this model's maximum context length is {limit} tokens; the request has {wanted}",
                         code="context_length_exceeded")


class _Tracker:
    """Timing and metrics of one request; `finish` records it once."""

    def __init__(self, state: ServerState, prompt_ids: list[int], tenant: Tenant, namespace: CacheNamespace):
        self.state = state
        self.prompt_ids = prompt_ids
        self.tenant = tenant.name
        self.namespace = namespace
        self.arrival = time.perf_counter()
        self.wall_ms = time.time() * 1000.0
        self.first_token: float | None = None
        self.done = False
        state.metrics.in_flight.inc()
        state.metrics.version += 1

    def saw(self, out: StepOutput) -> None:
        if self.first_token is None and out.new_token_ids:
            self.first_token = time.perf_counter()
            self.state.metrics.ttft.observe(self.first_token - self.arrival)

    def finish(self, out: StepOutput | None) -> None:
        if self.done:
            return
        self.done = True
        m = self.state.metrics
        m.in_flight.dec()
        m.version += 1
        reason = out.finish_reason if out is not None and out.finish_reason else "abort"
        m.requests.labels(reason).inc()
        m.latency.observe(time.perf_counter() - self.arrival)
        if out is None or reason == "error":
            return
        usage = out.usage
        m.generation_tokens.inc(usage.completion_tokens)
        m.request_prompt_tokens.inc(usage.prompt_tokens)
        m.tenant_prompt_tokens.labels(self.tenant).inc(usage.prompt_tokens)
        for tier, n in usage.cached_tokens.items():
            m.request_cached_tokens.labels(tier).inc(n)
            m.tenant_cached_tokens.labels(self.tenant, tier).inc(n)
        if self.state.trace is not None and reason != "abort":
            ttft = None if self.first_token is None else (self.first_token - self.arrival) * 1000.0
            self.state.trace.submit(
                FinishedRequest(self.wall_ms, self.prompt_ids, usage.completion_tokens, dict(usage.cached_tokens), ttft,
                                self.namespace.id)
            )


def _error_from_output(out: StepOutput) -> p.APIError:
    if out.error and out.error.startswith(("engine is not running", "engine failure", "engine shut down")):
        return p.APIError(503, out.error, "server_error")
    if out.error and out.error.startswith("the engine failed"):  # its step raised (Engine._fail): ours, not theirs
        return p.APIError(500, out.error, "server_error")
    return p.APIError(400, out.error or "request failed")


async def _watch_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    """Abort request_id when the client goes away (the body has been read: receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.info("%s: client disconnected; aborting", request_id)
            engine.abort(request_id)
            return


async def generate(state: ServerState, request: Request, req: Any, prompt: Any, chat: bool, tenant: Tenant) -> Response:
    """Run one request of `tenant` in its cache namespace (tenants.py) and answer it."""
    if req.model is not None and req.model != state.model_name:
        raise p.APIError(404, f"the model '{req.model}' does not exist (this server serves '{state.model_name}')",
                         param="model", code="model_not_found")
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    params = p.sampling_params(req, max_tokens)
    prompt_ids = await _tokenize(state, prompt, chat)
    _check_context(state, len(prompt_ids), params.max_tokens)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    namespace = state.tenants.namespace(tenant, req.cache_salt)
    tracker = _Tracker(state, prompt_ids, tenant, namespace)
    engine = state.engine
    outputs = engine.generate(request_id, prompt_ids, params, namespace)
    watcher = asyncio.create_task(_watch_disconnect(request, engine, request_id))
    streaming = False
    try:
        first = await anext(outputs)
        tracker.saw(first)
        if first.finish_reason == "error":
            tracker.finish(first)
            raise _error_from_output(first)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _stream(state, request_id, first, outputs, tracker, chat, include_usage)
            streaming = True  # from here _stream owns the request
            return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, last = first.text_delta, first
        try:
            async for out in outputs:
                tracker.saw(out)
                text += out.text_delta
                last = out
        except asyncio.CancelledError:
            # the server cancels what is left once its drain timeout is over (a client that goes away aborts the
            # request through the watcher instead): the client still gets an answer, and the log one line
            logger.warning("%s: the server shut down before the request finished (--drain-timeout); answered 503",
                           request_id)
            raise p.APIError(503, "the server shut down before this request finished (its drain timeout ran "
                             "out); retry it on a running server", "server_error") from None
        tracker.finish(last)
        if last.finish_reason == "error":
            raise _error_from_output(last)
        created, name = p.now(), state.model_name
        if chat:
            return JSONResponse(p.chat_body(request_id, name, created, text, last.finish_reason, last.usage))
        return JSONResponse(p.completion_body(request_id, name, created, text, last.finish_reason, last.usage))
    finally:
        watcher.cancel()  # a stream is watched by StreamingResponse, which cancels _stream on disconnect
        if not streaming:
            tracker.finish(None)  # no-op unless cancelled or failed before the end
            await outputs.aclose()  # aborts the request if it is still running


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(state: ServerState, request_id: str, first: StepOutput, outputs: AsyncIterator[StepOutput],
                  tracker: _Tracker, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of one request; if the client goes away (the task is cancelled) the request is aborted."""
    created, model = p.now(), state.model_name
    last: StepOutput | None = None
    try:
        if chat:
            yield _sse(p.chat_chunk(request_id, model, created, {"role": "assistant", "content": ""}, None))
        out: StepOutput | None = first
        while out is not None:
            tracker.saw(out)
            first_token = last is None
            last = out
            if out.finish_reason == "error":
                yield _sse(p.error_body(out.error or "request failed", "server_error"))
                break
            # the first token is always sent, even before it decodes to text, so streaming clients see TTFT
            if out.text_delta or out.finished or (first_token and not chat):
                reason = out.finish_reason if out.finished else None
                if chat:
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    yield _sse(p.chat_chunk(request_id, model, created, delta, reason))
                else:
                    yield _sse(p.completion_body(request_id, model, created, out.text_delta, reason, None, chunk=True))
            out = None if out.finished else await anext(outputs, None)
        if include_usage and last is not None and last.finish_reason != "error":
            yield _sse(p.usage_chunk(request_id, model, created, last.usage, chat))
        yield "data: [DONE]\n\n"
    finally:
        if last is None or not last.finished:
            state.engine.abort(request_id)
        tracker.finish(last if last is not None and last.finished else None)
        await outputs.aclose()
