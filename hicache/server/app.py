"""The FastAPI application: OpenAI endpoints over an AsyncEngine, health, Prometheus metrics, auth.

Request flow: read the body (size-limited), parse JSON and validate it (pydantic) -> tokenize in a
worker thread -> check the context limit -> `AsyncEngine.generate` (the engine runs on its own thread)
-> JSON or SSE. A client that disconnects aborts its request, which frees its pages. Every error is
an OpenAI error object: 400 bad input, 401 bad key, 404 unknown model or path, 413 body too large.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache.config import Config
from hicache.engine.params import SamplingParams
from hicache.engine.request import StepOutput
from hicache.engine.runner import AsyncEngine
from hicache.server import protocol as p
from hicache.server.metrics import CONTENT_TYPE, ServerMetrics
from hicache.server.trace_log import FinishedRequest, TraceLog

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the handlers share."""

    engine: AsyncEngine
    config: Config
    model_name: str
    metrics: ServerMetrics
    trace: TraceLog | None
    api_key: str | None
    created: int


# ---------------------------------------------------------------------- request parsing


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 beyond `limit` bytes, 400 if it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise p.APIError(413, f"request body is {length} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise p.APIError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise p.APIError(400, f"malformed JSON body: {e}") from None


def validate(model: type[BaseModel], data: Any) -> Any:
    """data as `model`, or a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(part) for part in err["loc"]) or None
        raise p.APIError(400, f"{param or 'body'}: {err['msg']}", param=param) from None


def sampling_params(req: p.CompletionRequest | p.ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
    """The engine's SamplingParams for a request; 400 for unsupported or impossible values."""
    unsupported = {"n": req.n != 1, "logprobs": bool(req.logprobs),
                   "presence_penalty": req.presence_penalty != 0, "frequency_penalty": req.frequency_penalty != 0}
    if isinstance(req, p.CompletionRequest):
        unsupported.update(echo=req.echo, best_of=req.best_of not in (None, 1), suffix=bool(req.suffix))
    for name, bad in unsupported.items():
        if bad:
            raise p.APIError(400, f"{name}={getattr(req, name)!r} is not supported", param=name)
    values: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "seed": req.seed}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            values[name] = getattr(req, name)
    if req.stop is not None:
        values["stop"] = req.stop
    if req.stop_token_ids is not None:
        values["stop_token_ids"] = tuple(req.stop_token_ids)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise p.APIError(400, str(e), param=param if param in values else None) from None


def chat_messages(req: p.ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: text content only."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise p.APIError(400, f"messages.{i}.content: only text parts are supported",
                                     param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": m.role, "content": content or ""})
    return out


def completion_prompt(req: p.CompletionRequest) -> str | list[int]:
    """The single prompt of a completion request (text or token ids)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.APIError(400, f"got {len(prompt)} prompts; one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    return prompt


# ---------------------------------------------------------------------- the app


def create_app(engine: AsyncEngine, config: Config, model_name: str, api_key: str | None = None,
               trace_log: str | None = None) -> FastAPI:
    """The server app over a running AsyncEngine; its lifespan shuts the engine down (closing L3)."""
    prometheus_client.disable_created_metrics()
    cache = engine.engine.cache
    state = ServerState(
        engine, config, model_name, ServerMetrics(cache.sizes.page_bytes),
        TraceLog(trace_log, cache.namespace, cache.layout.page_size) if trace_log else None,
        api_key, p.now(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.trace is not None:
            await state.trace.start()
        yield
        # uvicorn has drained in-flight requests by now
        if state.trace is not None:
            await state.trace.close()
        logger.info("shutting down the engine (finishing L3 writes, closing the store)")
        await asyncio.to_thread(engine.shutdown, 120.0)

    app = FastAPI(title="hicache", lifespan=lifespan)
    app.state.hicache = state

    @app.exception_handler(p.APIError)
    async def api_error(_: Request, e: p.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        param = ".".join(str(x) for x in err["loc"] if x != "body") or None
        return JSONResponse(p.error_body(f"{param or 'body'}: {err['msg']}", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(p.error_body(str(e.detail), kind), status_code=e.status_code)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise p.APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        runner = engine.runner
        if runner.error is not None:
            return JSONResponse({"status": "error", "error": repr(runner.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await asyncio.wait_for(engine.stats(), timeout=2.0)
        except (asyncio.TimeoutError, Exception):  # engine busy or gone: its last published snapshot
            stats = engine.runner.stats()
        l3 = await asyncio.to_thread(cache.l3.stats) if cache.l3 is not None else None
        return Response(state.metrics.render(stats, l3), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "hicache",
                "max_model_len": engine.engine.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = validate(p.CompletionRequest, await read_json(request, config.server.max_body_bytes))
        prompt = completion_prompt(req)
        return await _generate(state, request, req, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = validate(p.ChatCompletionRequest, await read_json(request, config.server.max_body_bytes))
        messages = chat_messages(req)
        return await _generate(state, request, req, messages, chat=True)

    return app


# ---------------------------------------------------------------------- generation


async def _tokenize(state: ServerState, prompt: str | list[int] | list[dict[str, Any]], chat: bool) -> list[int]:
    tokenizer = state.engine.tokenizer

    def work() -> list[int]:
        if chat:
            try:
                text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            except Exception as e:  # the template rejected the conversation (e.g. roles out of order)
                raise p.APIError(400, f"messages: {e}", param="messages") from None
            return tokenizer.encode(text)
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

    def __init__(self, state: ServerState, prompt_ids: list[int]):
        self.state = state
        self.prompt_ids = prompt_ids
        self.arrival = time.perf_counter()
        self.wall_ms = time.time() * 1000.0
        self.first_token: float | None = None
        self.done = False
        state.metrics.in_flight.inc()

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
        reason = out.finish_reason if out is not None and out.finish_reason else "abort"
        m.requests.labels(reason).inc()
        m.latency.observe(time.perf_counter() - self.arrival)
        if out is None or reason == "error":
            return
        usage = out.usage
        m.generation_tokens.inc(usage.completion_tokens)
        m.request_prompt_tokens.inc(usage.prompt_tokens)
        for tier, n in usage.cached_tokens.items():
            m.request_cached_tokens.labels(tier).inc(n)
        if self.state.trace is not None and reason != "abort":
            ttft = None if self.first_token is None else (self.first_token - self.arrival) * 1000.0
            self.state.trace.submit(
                FinishedRequest(self.wall_ms, self.prompt_ids, usage.completion_tokens, dict(usage.cached_tokens), ttft)
            )


def _error_from_output(out: StepOutput) -> p.APIError:
    if out.error and out.error.startswith(("engine is not running", "engine failure", "engine shut down")):
        return p.APIError(503, out.error, "server_error")
    return p.APIError(400, out.error or "request failed")


async def _watch_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    """Abort request_id when the client goes away (the body has been read: receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.info("%s: client disconnected; aborting", request_id)
            engine.abort(request_id)
            return


async def _generate(state: ServerState, request: Request, req: Any, prompt: Any, chat: bool) -> Response:
    if req.model is not None and req.model != state.model_name:
        raise p.APIError(404, f"the model '{req.model}' does not exist (this server serves '{state.model_name}')",
                         param="model", code="model_not_found")
    max_tokens = req.max_tokens
    if chat and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    params = sampling_params(req, max_tokens)
    prompt_ids = await _tokenize(state, prompt, chat)
    _check_context(state, len(prompt_ids), params.max_tokens)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tracker = _Tracker(state, prompt_ids)
    engine = state.engine
    outputs = engine.generate(request_id, prompt_ids, params)
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
        async for out in outputs:
            tracker.saw(out)
            text += out.text_delta
            last = out
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
            last = out
            if out.finish_reason == "error":
                yield _sse(p.error_body(out.error or "request failed", "server_error"))
                break
            if out.text_delta or out.finished:
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
