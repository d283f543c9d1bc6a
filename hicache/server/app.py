"""The FastAPI application: OpenAI endpoints over an AsyncEngine, health, Prometheus metrics, auth.

Request flow: read the body (size-limited), parse JSON and validate it (pydantic, protocol.py) ->
generation.py: tokenize in a worker thread, check the context limit, run on the engine thread, answer
JSON or SSE. The API key names the request's tenant, whose cache namespace (with the request's
`cache_salt`) it matches and fills (tenants.py). Every error is an OpenAI error object: 400 bad input, 401 bad
key, 404 unknown model or path, 413 body too large. The app's shutdown (after uvicorn drained requests) stops
the engine, which closes the L3 store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache.config import Config
from hicache.engine.runner import AsyncEngine
from hicache.server import protocol as p
from hicache.server.generation import ServerState, generate
from hicache.server.metrics import CONTENT_TYPE, ServerMetrics
from hicache.server.tenants import Tenant, Tenants
from hicache.server.trace_log import TraceLog

logger = logging.getLogger(__name__)

# /metrics renders its text at most this often, sooner once a request started or finished: a render costs the
# interpreter lock the engine thread needs, and scrapers (eight, back to back) slowed requests fivefold
METRICS_TTL_S = 1.0


def create_app(engine: AsyncEngine, config: Config, model_name: str, tenants: Tenants | None = None,
               trace_log: str | None = None) -> FastAPI:
    """The server app over a running AsyncEngine; its lifespan shuts the engine down (closing L3). `tenants`:
    who may call it and in which cache namespace (default: everyone, in one)."""
    prometheus_client.disable_created_metrics()
    cache = engine.engine.cache
    # the most text (in bytes) and so the most commas a request that fits the context can hold: token ids, and the
    # commas of its text, plus the other fields' (stop token ids, stop strings), worked out before serving
    max_commas = engine.engine.max_context * (engine.tokenizer.max_token_bytes + 3) + 4096
    tenants = tenants if tenants is not None else Tenants.build(None, None)
    state = ServerState(
        engine, config, model_name, ServerMetrics(cache.sizes.page_bytes, tenants.group_names(), tenants.names),
        TraceLog(trace_log, cache.namespace, cache.layout.page_size) if trace_log else None,
        tenants, p.now(),
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

    # the interactive docs describe the API to whoever asks: not when the API is behind a key
    docs = {} if not tenants.auth_required else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="hicache", lifespan=lifespan, **docs)
    app.state.hicache = state

    @app.exception_handler(p.APIError)
    async def api_error(_: Request, e: p.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(p.ClientGone)
    async def client_gone(request: Request, _: p.ClientGone) -> Response:
        # a client that left while sending costs one quiet line, not a traceback (cheap connections would flood
        # the log); the response goes nowhere
        logger.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        param = ".".join(str(x) for x in err["loc"] if x != "body") or None
        return JSONResponse(p.error_body(f"{param or 'body'}: {err['msg']}", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(p.error_body(str(e.detail), kind), status_code=e.status_code)

    def authorize(request: Request) -> Tenant:
        tenant = tenants.authenticate(request.headers.get("authorization", ""))
        if tenant is None:
            raise p.APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             code="invalid_api_key")
        return tenant

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        runner = engine.runner
        if runner.error is not None:
            return JSONResponse({"status": "error", "error": repr(runner.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    taking: dict[str, asyncio.Task[dict[str, Any]]] = {}  # the engine-thread stats call in flight, if any

    def taken(task: asyncio.Task[dict[str, Any]]) -> None:
        taking.pop("stats", None)
        if not task.cancelled():
            task.exception()  # retrieved: every scrape that awaited it fell back on its own

    async def engine_stats() -> dict[str, Any]:
        """A fresh snapshot of the engine's stats; scrapes that come while one is being taken share it, so that
        many scrapers cost the engine thread one call, not one each."""
        task = taking.get("stats")
        if task is None:
            task = taking["stats"] = asyncio.ensure_future(asyncio.wait_for(engine.stats(), timeout=2.0))
            task.add_done_callback(taken)
        try:
            return await asyncio.shield(task)
        except Exception:  # engine busy (timeout) or gone: its last published snapshot
            return engine.runner.stats()

    rendered: dict[bool, tuple[float, int, bytes]] = {}  # tenant series shown -> (when, metrics version, text)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        show = tenants.may_see_tenant_series(request.headers.get("authorization", ""), config.server.metrics_key)
        now, version = time.monotonic(), state.metrics.version
        last = rendered.get(show)
        if last is not None and now - last[0] < METRICS_TTL_S and last[1] == version:
            return Response(last[2], media_type=CONTENT_TYPE)  # many scrapers cost one render a second
        stats = await engine_stats()
        l3 = await asyncio.to_thread(cache.l3.stats) if cache.l3 is not None else None
        # rendered off the event loop: the streams being sent do not wait for it
        text = await asyncio.to_thread(state.metrics.render, stats, l3, show)
        rendered[show] = (now, version, text)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        card = {"id": model_name, "object": "model", "created": state.created, "owned_by": "hicache",
                "max_model_len": engine.engine.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = authorize(request)
        req = await p.read_request(request, config.server.max_body_bytes, p.CompletionRequest, max_commas)
        prompt = p.completion_prompt(req)
        return await generate(state, request, req, prompt, chat=False, tenant=tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = authorize(request)
        req = await p.read_request(request, config.server.max_body_bytes, p.ChatCompletionRequest, max_commas)
        messages = p.chat_messages(req)
        return await generate(state, request, req, messages, chat=True, tenant=tenant)

    return app
