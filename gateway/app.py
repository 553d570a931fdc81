"""create_app(): the Starlette application `llmq serve` runs under uvicorn.

    GET  /health                  the gateway answers and Redis is reachable (no key needed)
    GET  /metrics                 Prometheus: the gateway's and the pool's series (no key needed
                                  unless --metrics-require-key; gateway/pool_metrics.py)
    GET  /v1/models               the models live workers serve (from their heartbeats)
    GET  /v1/models/{id}          one of them
    GET  /version, /openapi.json  llmq's version; an outline of these routes (no key needed)
    POST /v1/responses            OpenAI's Responses API (gateway/responses.py)
    POST /v1/embeddings, /tokenize, /detokenize   answered from a prompt (gateway/prompt_tasks.py)
    GET  /dashboard               the pool's web dashboard and its API (gateway/dashboard.py)
    the completion routes         gateway/completions.py
    the Files and Batch APIs      gateway/files.py, gateway/batches.py

Every response carries `X-Request-Id`; every error has OpenAI's shape (`{"error": {...}}`) and
status. The middleware is plain ASGI (no per-request task), so a streamed token costs one send.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmq import __version__
from llmq.broker import tracing
from llmq.broker.aio import AsyncClient
from llmq.broker.connection import connect
from llmq.gateway import batches, completions, dashboard, files, prompt_tasks, responses
from llmq.gateway.body_limit import BodyLimit
from llmq.gateway.errors import APIError
from llmq.gateway.pool_series import PoolSeries
from llmq.gateway.pool_view import PoolView, ServedModel, names_model
from llmq.gateway.request_tracing import TracedRequests
from llmq.gateway.settings import GatewaySettings
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol.errors import LLMQError, RequestIdConflict

__all__ = ["CLIENT_NAME", "create_app"]

logger = logging.getLogger(__name__)

CLIENT_NAME = "llmq-gateway"  # what the gateway's connections are called in CLIENT LIST


async def health(request: Request) -> Response:
    state = GatewayState.of(request)
    try:
        await state.client.ping()
    except LLMQError as exc:
        return json_response({"status": "unavailable", "error": str(exc)}, 503)
    return json_response({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = GatewayState.of(request)
    if state.settings.metrics_require_key:
        state.tenant(request)
    await state.metrics.pool.refresh(state.client, await state.pool.workers(),
                                     await state.queues())
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(request: Request) -> Response:
    state = GatewayState.of(request)
    state.tenant(request)
    data = [_model_object(m) for m in await state.pool.models()]
    return json_response({"object": "list", "data": data})


async def model(request: Request) -> Response:
    """GET /v1/models/{model_id}: one served model, or 404 model_not_found."""
    state = GatewayState.of(request)
    state.tenant(request)
    wanted = request.path_params["model_id"]
    for m in await state.pool.models():
        if wanted and names_model(wanted, m.name):
            return json_response(_model_object(m))
    raise APIError(404, f"the model `{wanted}` does not exist or no worker serves it",
                   "invalid_request_error", param="model", code="model_not_found")


def _model_object(m: ServedModel) -> dict[str, Any]:
    """OpenAI's model object; a LoRA adapter also names its base model (`parent`, as vLLM)."""
    data: dict[str, Any] = {"id": m.name, "object": "model", "created": m.created,
                            "owned_by": "llmq", "queues": list(m.queues)}
    if m.parent is not None:
        data["parent"] = m.parent
    return data


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


async def openapi(request: Request) -> Response:
    """An OpenAPI 3.1 outline of the routes (paths and methods; the bodies are OpenAI's)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        if isinstance(route, Route) and not route.path.startswith("/dashboard"):
            for method in sorted((route.methods or set()) - {"HEAD"}):
                paths.setdefault(route.path_format, {})[method.lower()] = {
                    "operationId": f"{method.lower()}_{route.name}",
                    "summary": (route.endpoint.__doc__ or route.name).strip().splitlines()[0],
                    "responses": {"200": {"description": "OK"}}}
    return json_response({"openapi": "3.1.0", "info": {"title": "llmq gateway",
                                                       "version": __version__},
                          "components": {"securitySchemes": {"bearer": {
                              "type": "http", "scheme": "bearer"}}},
                          "security": [{"bearer": []}], "paths": paths})


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    Route("/v1/responses", responses.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
    Route("/v1/chat/completions", completions.create_chat, methods=["POST"]),
    Route("/v1/completions", completions.create_completion, methods=["POST"]),
    Route("/v1/embeddings", prompt_tasks.create_embeddings, methods=["POST"]),
    Route("/tokenize", prompt_tasks.tokenize, methods=["POST"]),
    Route("/detokenize", prompt_tasks.detokenize, methods=["POST"]),
    Route("/v1/chat/completions/{request_id}/stream", completions.resume_chat, methods=["GET"]),
    Route("/v1/completions/{request_id}/stream", completions.resume_completion,
          methods=["GET"]),
    Route("/v1/chat/completions/{request_id}/cancel", completions.cancel_chat,
          methods=["POST"]),
    Route("/v1/completions/{request_id}/cancel", completions.cancel_completion,
          methods=["POST"]),
    Route("/v1/files", files.upload_file, methods=["POST"]),
    Route("/v1/files", files.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", files.get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
    Route("/v1/batches", batches.create_batch, methods=["POST"]),
    Route("/v1/batches", batches.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batches.get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
    *dashboard.ROUTES,
]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return json_response(exc.body(), exc.status, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return json_response({"error": {"message": str(exc.detail), "type": kind, "param": None,
                                    "code": code}}, exc.status_code, dict(exc.headers or {}))


async def _broker_error(request: Request, exc: Exception) -> Response:
    logger.warning("%s %s: %s", request.method, request.url.path, exc)
    if isinstance(exc, RequestIdConflict):
        # NOTE: an X-Request-Id reused after its request was lost or its result expired.
        return json_response({"error": {"message": str(exc), "type": "invalid_request_error",
                                        "param": None, "code": "request_id_conflict"}}, 409)
    return json_response({"error": {"message": str(exc), "type": "server_error", "param": None,
                                    "code": "broker_unavailable"}}, 503)


class RequestIdAndMetrics:
    """X-Request-Id on every response, and one metrics observation per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        request_id = None

        async def send_with_id(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    request_id = (scope.get("state", {}).get("request_id")
                                  or _header(scope, b"x-request-id") or uuid.uuid4().hex)
                    headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            app = scope.get("app")
            state: GatewayState | None = (getattr(app.state, "gateway", None)
                                          if app is not None else None)
            if state is not None:
                state.metrics.observe(scope["method"], getattr(route, "path", "unmatched"),
                                      status, time.perf_counter() - started)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            text = value.decode("latin-1")
            return text if len(text) <= 128 else None
    return None


SHUTDOWN_STEP_S = 5.0  # each step of the lifespan's teardown, before it is given up on


async def _stop_within(seconds: float, tasks: list[asyncio.Task[None]],
                       client: AsyncClient) -> None:
    """Cancel the background tasks and close the client, each step bounded: a gateway told to
    stop exits, and the log names the step that did not finish (with its task's stack)."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    for task in pending:
        where = io.StringIO()
        task.print_stack(file=where)
        logger.warning("shutdown: a background task did not stop within %gs:\n%s", seconds,
                       where.getvalue())
    try:
        await asyncio.wait_for(client.close(), seconds)
    except TimeoutError:
        logger.warning("shutdown: closing the Redis clients took over %gs; left to exit", seconds)


def create_app(settings: GatewaySettings, *, redis_url: str | None = None,
               shutting_down: Callable[[], bool] | None = None) -> Starlette:
    """The gateway app; its Redis clients open in the lifespan (one set per process).

    `shutting_down`: says when the server has begun to stop (uvicorn's `should_exit`).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        client = AsyncClient(redis_url, settings=settings.broker,
                             max_connections=settings.max_connections, client_name=CLIENT_NAME)
        sync_redis: redis.Redis = connect(client.url, max_connections=8, client_name=CLIENT_NAME)
        pool = PoolView(client, settings.broker.queue, settings.max_queue)
        series = PoolSeries(client, pool, settings.dashboard_interval)
        app.state.gateway = GatewayState(settings, client, pool, sync_redis, series,
                                         shutting_down=shutting_down or (lambda: False))
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pool.refresh_forever()), loop.create_task(series.run_forever())]
        try:
            yield {}
        finally:
            await _stop_within(SHUTDOWN_STEP_S, tasks, client)
            sync_redis.close()

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, LLMQError: _broker_error})
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes,
                       max_file_bytes=settings.max_file_bytes)
    app.add_middleware(RequestIdAndMetrics)
    if (traced := tracing.current()) is not None:
        app.add_middleware(TracedRequests, tracing_=traced)
    return app
