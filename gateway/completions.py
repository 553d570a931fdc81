"""The completion routes: create (streaming or not), resume a stream, cancel.

    POST /v1/chat/completions              POST /v1/completions
    GET  /v1/chat/completions/{id}/stream  GET  /v1/completions/{id}/stream   (Last-Event-ID)
    POST /v1/chat/completions/{id}/cancel  POST /v1/completions/{id}/cancel

A request's llmq id is `<tenant>:<id>`, `<id>` being the `X-Request-Id` the client sent (a retried
POST with the same id is queued once and answered from the same run) or a fresh one; the response
carries it back in `X-Request-Id`, and the response objects' ids are `chatcmpl-<id>` /
`cmpl-<id>`. Streams send `id: <result stream entry id>` with every event; resuming with
`Last-Event-ID` (header, or `?after=`) continues exactly after that event, on any replica, until
the result expires. A client that goes away cancels its request, unless it sent
`X-Keep-On-Disconnect: true` (to resume later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmq.broker.commands import Followed
from llmq.broker.multiplex import parse_entry_id
from llmq.broker.transcript import Fold
from llmq.gateway.errors import bad_request, not_found
from llmq.gateway.openai_request import CHAT, COMPLETIONS, BodyError, Endpoint, decode_body
from llmq.gateway.openai_response import (
    DONE_FRAME,
    CompletionStream,
    LogprobsBuilder,
    completion_id,
    completion_object,
    error_body,
    error_status,
    sse,
)
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol import Delta, Done, Error, Start
from llmq.protocol.errors import LLMQError, ResultTimeout
from llmq.protocol.names import is_valid_name

__all__ = ["cancel_chat", "cancel_completion", "create_chat", "create_completion",
           "resume_chat", "resume_completion"]

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
KEEP_HEADER = "x-keep-on-disconnect"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_chat(request: Request) -> Response:
    return await _create(request, CHAT)


async def create_completion(request: Request) -> Response:
    return await _create(request, COMPLETIONS)


async def resume_chat(request: Request) -> Response:
    return await _resume(request, CHAT)


async def resume_completion(request: Request) -> Response:
    return await _resume(request, COMPLETIONS)


async def cancel_chat(request: Request) -> Response:
    return await _cancel(request, CHAT)


async def cancel_completion(request: Request) -> Response:
    return await _cancel(request, COMPLETIONS)


# -- create ---------------------------------------------------------------------------------------


async def _create(request: Request, endpoint: Endpoint) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    public_id = _public_id(request, tenant)
    try:
        parsed = decode_body(endpoint, await request.body())
    except BodyError as exc:
        raise bad_request(str(exc), exc.param) from None
    queue = await state.pool.route(parsed.model)
    request_id = f"{tenant}:{public_id}"
    keep = _truthy(request.headers.get(KEEP_HEADER))
    options = {"endpoint": endpoint, "include_usage": int(parsed.include_usage),
               "keep": int(keep), "model": parsed.model or "", "n": parsed.n}
    # NOTE: deltas are only needed to stream, or to collect logprobs; otherwise the worker
    # writes just `start` and `done`. The stream options and the request go in parallel: a
    # resume can only come once the client has the id, after this returns.
    stream_events = parsed.stream or parsed.logprobs is not None
    await asyncio.gather(
        state.remember_stream(request_id, options),
        state.client.submit(request_id=request_id, queue=queue, stream=stream_events,
                            **parsed.request))
    headers = {"X-Request-Id": public_id}
    if parsed.stream:
        stream = CompletionStream(endpoint, public_id, parsed.model or "", parsed.include_usage,
                                  parsed.logprobs is not None, parsed.n)
        cancel_queue = None if keep else queue
        return StreamingResponse(_sse(state, request_id, stream, cancel_queue), headers={
            **_SSE_HEADERS, **headers}, media_type="text/event-stream")
    answer = asyncio.ensure_future(_collect(state, endpoint, public_id, request_id, parsed.model))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
            if not keep and not state.shutting_down():
                await state.cancel(request_id, queue)
    if not answer.done() or answer.cancelled():
        return Response(status_code=499, headers=headers)  # nobody is there to read it
    status, payload = answer.result()
    if status == 504 and not keep:
        await state.cancel(request_id, queue)
    return json_response(payload, status, headers)


async def _collect(state: GatewayState, endpoint: str, public_id: str, request_id: str,
                   model: str | None) -> tuple[int, Any]:
    """(status, body) of a request followed to its end."""
    logprobs: dict[int, LogprobsBuilder] = {}  # by choice index
    created, served = 0, model or ""
    try:
        async with _following(state, request_id) as events:
            async for followed in events:
                event = followed.event
                created = created or parse_entry_id(followed.entry_id)[0] // 1000
                if followed.fold is Fold.RESTARTED:
                    logprobs = {}
                if isinstance(event, Start):
                    served = event.model or served
                elif isinstance(event, Delta) and event.logprobs is not None:
                    if (builder := logprobs.get(event.index)) is None:
                        builder = logprobs[event.index] = LogprobsBuilder(endpoint)
                    builder.add(event.text, event.logprobs)
                elif isinstance(event, Done):
                    if event.finish_reason == "cancelled":
                        return 409, error_body("the request was cancelled", "server_error",
                                               "cancelled")
                    return 200, completion_object(
                        endpoint, completion_id(endpoint, public_id), served, created, event,
                        {index: b.result() for index, b in logprobs.items()})
                elif isinstance(event, Error):
                    status, kind = error_status(event.code)
                    return status, error_body(event.message, kind, _openai_code(event.code))
    except ResultTimeout:
        return 504, error_body(f"no answer within the gateway's request timeout "
                               f"({state.settings.request_timeout:g}s)", "server_error",
                               "timeout")
    except LLMQError as exc:
        return 503, error_body(str(exc), "server_error", "broker_unavailable")
    raise AssertionError("follow() ends only after a terminal event")


def _openai_code(code: str) -> str:
    return "context_length_exceeded" if code == "prompt_too_long" else code


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def _following(state: GatewayState, request_id: str, after: str | None = None
                     ) -> AsyncGenerator[AsyncIterator[Followed], None]:
    """The request's events, closed on leaving, however that happens: its follower unsubscribes
    at once rather than whenever the garbage collector finalizes the generator."""
    events = state.client.follow(request_id, timeout=state.settings.request_timeout, after=after)
    try:
        yield events
    finally:
        # NOTE: AsyncClient.follow is an async generator, though typed as an AsyncIterator.
        if isinstance(events, AsyncGenerator):
            await events.aclose()


# -- streaming ------------------------------------------------------------------------------------


async def _sse(state: GatewayState, request_id: str, stream: CompletionStream,
               cancel_queue: str | None, after: str | None = None
               ) -> AsyncGenerator[bytes, None]:
    """The request's events as SSE frames; a client that goes away cancels the request when
    `cancel_queue` names its queue (Starlette cancels this generator on a disconnect)."""
    state.metrics.open_streams.inc()
    timed_out = False
    try:
        async with _following(state, request_id, after) as events:
            async for followed in events:
                for frame in stream.feed(followed):
                    yield frame
                if stream.finished:
                    return
    except ResultTimeout:
        stream.finished = timed_out = True
        yield sse(error_body(f"no answer within the gateway's request timeout "
                             f"({state.settings.request_timeout:g}s)", "server_error", "timeout"))
        yield DONE_FRAME
    except LLMQError as exc:
        stream.finished = True
        yield sse(error_body(str(exc), "server_error", "broker_unavailable"))
        yield DONE_FRAME
    finally:
        state.metrics.open_streams.dec()
        # NOTE: a timed-out stream is cancelled like a timed-out non-streaming request: nobody
        # reads what it would still generate.
        if ((timed_out or not stream.finished) and cancel_queue is not None
                and not state.shutting_down()):
            # NOTE: shielded: the disconnect cancelled this task, and the cancel must still go.
            with anyio.CancelScope(shield=True):
                state.metrics.cancelled.inc()
                await state.cancel(request_id, cancel_queue)


async def _resume(request: Request, endpoint: Endpoint) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    public_id = _path_id(request, endpoint)
    request_id = f"{tenant}:{public_id}"
    options = await state.stream_options(request_id)
    if options is None:
        raise not_found(f"no request {public_id!r} (unknown, another key's, or expired)")
    after = request.headers.get("last-event-id") or request.query_params.get("after")
    if after is not None:
        try:
            parse_entry_id(after)
        except ValueError:
            raise bad_request(f"Last-Event-ID {after!r:.60} is not an event id of this "
                              "stream", "Last-Event-ID") from None
    stream = CompletionStream(endpoint, public_id, options.get("model", ""),
                              options.get("include_usage") == "1", True,
                              int(options.get("n") or 1))
    # NOTE: a resumed stream never cancels on disconnect: whoever resumes wants the answer.
    return StreamingResponse(_sse(state, request_id, stream, None, after), headers={
        **_SSE_HEADERS, "X-Request-Id": public_id}, media_type="text/event-stream")


# -- cancel ---------------------------------------------------------------------------------------


async def _cancel(request: Request, endpoint: Endpoint) -> Response:
    state = GatewayState.of(request)
    tenant = state.tenant(request)
    public_id = _path_id(request, endpoint)
    request_id = f"{tenant}:{public_id}"
    if await state.stream_options(request_id) is None:
        raise not_found(f"no request {public_id!r} (unknown, another key's, or expired)")
    await state.cancel_everywhere(request_id)
    return json_response({"id": completion_id(endpoint, public_id), "object": "cancellation",
                          "cancelled": True}, 200, {"X-Request-Id": public_id})


# -- ids ------------------------------------------------------------------------------------------


def _public_id(request: Request, tenant: str) -> str:
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        public_id = uuid.uuid4().hex
    elif not is_valid_name(given) or len(tenant) + 1 + len(given) > 128:
        raise bad_request(f"X-Request-Id {given!r:.60} must match [A-Za-z0-9_.:-] and be at "
                          f"most {127 - len(tenant)} characters", "X-Request-Id")
    else:
        public_id = given
    request.state.request_id = public_id
    return public_id


def _path_id(request: Request, endpoint: Endpoint) -> str:
    raw = request.path_params["request_id"]
    public_id = raw.removeprefix("chatcmpl-" if endpoint == CHAT else "cmpl-")
    if not is_valid_name(public_id):
        raise not_found(f"no request {raw!r:.60}")
    request.state.request_id = public_id
    return public_id


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")
