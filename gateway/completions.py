"""The completion routes: create (streaming or not), resume a stream, cancel.

    POST /v1/chat/completions              POST /v1/completions
    GET  /v1/chat/completions/{id}/stream  GET  /v1/completions/{id}/stream   (Last-Event-ID)
    POST /v1/chat/completions/{id}/cancel  POST /v1/completions/{id}/cancel

A request's llmq id is `<tenant>:<id>`, `<id>` being the `X-Request-Id` the client sent (a retried
POST with the same id is queued once and answered from the same run) or a fresh one; the response
carries it back in `X-Request-Id`, and the response objects' ids are `chatcmpl-<id>` /
`cmpl-<id>`. Streams send `id: <result stream entry id>` with every event; resuming with
`Last-Event-ID` (header, or `?after=`) continues exactly after that event, on any replica, until
the result expires. A stream whose client goes away is cancelled after a grace period
(`--disconnect-grace`, 30 s) unless it is resumed by then, so a dropped connection can resume
without having planned to; `X-Keep-On-Disconnect: true` keeps it running however long, `false`
cancels it at once (as does the cancel route). A client waiting for a whole (non-streamed)
answer that goes away cancels it at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmq.broker.commands import Followed
from llmq.broker.multiplex import parse_entry_id
from llmq.broker.transcript import Fold
from llmq.gateway.echo import EchoPlan
from llmq.gateway.errors import APIError, bad_request, not_found
from llmq.gateway.following import (
    admission,
    cancel_unless_resumed,
    close_follower,
    following,
    in_background,
    openai_code,
    timeout_body,
    unless_client_gone,
)
from llmq.gateway.openai_request import (
    CHAT,
    COMPLETIONS,
    BodyError,
    Endpoint,
    OpenAIRequest,
    decode_body,
)
from llmq.gateway.openai_response import (
    DONE_FRAME,
    CompletionStream,
    LogprobsBuilder,
    completion_id,
    completion_object,
    error_body,
    error_status,
    merge_completions,
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
_sorted_json = msgspec.json.Encoder(order="sorted")


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
    if parsed.more_prompts:
        return await _create_many(request, state, queue, tenant, public_id, parsed)
    request_id = f"{tenant}:{public_id}"
    keep_header = request.headers.get(KEEP_HEADER)  # absent: a drop has a grace period
    keep = _truthy(keep_header)
    options = {"endpoint": endpoint, "include_usage": int(parsed.include_usage),
               "keep": int(keep), "model": parsed.model or "", "n": parsed.n,
               "body": _digest(endpoint, parsed.request), "tool_calls": int(parsed.tool_calls),
               "continuous_usage": int(parsed.continuous_usage),
               "echo": _echo(parsed.request, parsed.echo)}
    if request.headers.get(REQUEST_ID_HEADER) is not None:
        known = await state.stream_options(request_id)
        if known is not None and known.get("body", options["body"]) != options["body"]:
            raise APIError(409, f"X-Request-Id {public_id!r} was used already for another "
                           "request: a retry must send the same body", "invalid_request_error",
                           code="request_id_conflict", param="X-Request-Id")
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
                                  parsed.logprobs is not None, parsed.n, parsed.tool_calls,
                                  parsed.continuous_usage, _echo(parsed.request, parsed.echo))
        cancel_queue = None if keep else queue
        events = state.client.follow(request_id, timeout=state.settings.request_timeout)
        admitted = await admission(state, request, request_id, queue, keep, events)
        if isinstance(admitted, Response):
            await close_follower(events)
            if admitted.status_code == 504 and not keep:
                await state.cancel(request_id, queue)
            admitted.headers.update(headers)
            return admitted
        return StreamingResponse(_sse(state, request_id, stream, cancel_queue, opened=(
            events, admitted), grace=0.0 if keep_header is not None
            else state.settings.disconnect_grace), headers={**_SSE_HEADERS, **headers},
            media_type="text/event-stream")
    outcome = await unless_client_gone(request, _collect(
        state, endpoint, public_id, request_id, parsed.model, parsed.tool_calls,
        await _echo_text(state, queue, request_id, parsed), parsed.echo_plan))
    if isinstance(outcome, tuple):
        status, payload = outcome
    else:
        if not keep and not state.shutting_down():
            await state.cancel(request_id, queue)
        return Response(status_code=499, headers=headers)  # nobody is there to read it
    if status == 504 and not keep:
        await state.cancel(request_id, queue)
    return json_response(payload, status, headers)


async def _create_many(request: Request, state: GatewayState, queue: str, tenant: str,
                       public_id: str, parsed: OpenAIRequest) -> Response:
    """Several prompts in one completions body: request `<id>.<k>` each, one answer whose
    choices are prompt k's completion j at index k * n + j, as OpenAI numbers them."""
    requests = [parsed.request, *parsed.more_prompts]
    ids = [f"{tenant}:{public_id}.{k}" for k in range(len(requests))]
    await asyncio.gather(*(state.client.submit(
        request_id=i, queue=queue, stream=parsed.logprobs is not None, **r)
        for i, r in zip(ids, requests, strict=True)))
    echoes = [await _echo_text(state, queue, i, parsed, r)
              for i, r in zip(ids, requests, strict=True)]
    answers = await unless_client_gone(request, asyncio.gather(*(
        _collect(state, COMPLETIONS, public_id, i, parsed.model, echo=echo,
                 echo_plan=parsed.echo_plan)
        for i, echo in zip(ids, echoes, strict=True))))
    if not isinstance(answers, list):
        for request_id in ids:
            await state.cancel(request_id, queue)
        return Response(status_code=499)
    status, body = merge_completions(answers, parsed.n)
    return json_response(body, status, {"X-Request-Id": public_id})


async def _collect(state: GatewayState, endpoint: str, public_id: str, request_id: str,
                   model: str | None, tool_calls: bool = False, echo: str = "",
                   echo_plan: EchoPlan | None = None) -> tuple[int, Any]:
    """(status, body) of a request followed to its end; `echo_plan` reshapes it (with the
    prompt's logprobs, or the prompt alone: gateway/echo.py)."""
    logprobs: dict[int, LogprobsBuilder] = {}  # by choice index
    created, served = 0, model or ""
    try:
        async with following(state, request_id) as events:
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
                    whole = completion_object(
                        endpoint, completion_id(endpoint, public_id), served, created, event,
                        {index: b.result() for index, b in logprobs.items()},
                        tool_calls=tool_calls, echo=echo)
                    return 200, whole if echo_plan is None else echo_plan.apply(
                        whole, event, echo)
                elif isinstance(event, Error):
                    status, kind = error_status(event.code)
                    return status, error_body(event.message, kind, openai_code(event.code))
    except ResultTimeout:
        return 504, timeout_body(state)
    except LLMQError as exc:
        return 503, error_body(str(exc), "server_error", "broker_unavailable")
    raise AssertionError("follow() ends only after a terminal event")


# -- streaming ------------------------------------------------------------------------------------


async def _sse(state: GatewayState, request_id: str, stream: CompletionStream,
               cancel_queue: str | None, after: str | None = None,
               opened: tuple[AsyncIterator[Followed], list[Followed]] | None = None,
               grace: float = 0.0) -> AsyncGenerator[bytes, None]:
    """The request's events as SSE frames; a client that goes away cancels the request when
    `cancel_queue` names its queue (Starlette cancels this generator on a disconnect), after
    `grace` seconds unless it is resumed by then. `opened`: the events already followed to
    the admission, and those read so far."""
    state.metrics.open_streams.inc()
    timed_out = False
    try:
        async with following(state, request_id, after,
                              None if opened is None else opened[0]) as events:
            for followed in [] if opened is None else opened[1]:
                for frame in stream.feed(followed):
                    yield frame
                if stream.finished:
                    return
            async for followed in events:
                for frame in stream.feed(followed):
                    yield frame
                if stream.finished:
                    return
    except ResultTimeout:
        stream.finished = timed_out = True
        yield sse(timeout_body(state))
        yield DONE_FRAME
    except LLMQError as exc:
        stream.finished = True
        yield sse(error_body(str(exc), "server_error", "broker_unavailable"))
        yield DONE_FRAME
    finally:
        state.metrics.open_streams.dec()
        # NOTE: a timed-out stream is cancelled at once, like a timed-out non-streaming
        # request: nobody reads what it would still generate.
        if ((timed_out or not stream.finished) and cancel_queue is not None
                and not state.shutting_down()):
            if grace > 0 and not timed_out:  # a resume within the grace keeps it running
                in_background(cancel_unless_resumed(state, request_id, cancel_queue, grace))
            else:
                # NOTE: shielded: the disconnect cancelled this task, and the cancel must go.
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
                              int(options.get("n") or 1), options.get("tool_calls") == "1",
                              options.get("continuous_usage") == "1", options.get("echo", ""))
    # NOTE: a resumed stream never cancels on disconnect: whoever resumes wants the answer;
    # and a stream dropped in its grace period is not cancelled once resumed.
    await state.remember_stream(request_id, {"resumed": time.time()})
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


def _digest(endpoint: Endpoint, llmq_request: dict[str, Any]) -> str:
    """What a retry with the same X-Request-Id must repeat: the endpoint and the request."""
    encoded = _sorted_json.encode([endpoint, llmq_request])
    return hashlib.sha256(encoded).hexdigest()[:32]


def _echo(llmq_request: dict[str, Any], echo: bool) -> str:
    """The text `echo` puts before a completion: its prompt."""
    return str(llmq_request.get("prompt", "")) if echo else ""


async def _echo_text(state: GatewayState, queue: str, request_id: str, parsed: OpenAIRequest,
                     llmq_request: dict[str, Any] | None = None) -> str:
    """The text `echo` puts before a completion: its prompt; a token-id prompt's is the
    worker's detokenization of it (special tokens kept), asked for as a request of its own."""
    fields = parsed.request if llmq_request is None else llmq_request
    if not parsed.echo or "prompt_token_ids" not in fields:
        return _echo(fields, parsed.echo)
    text_id = f"{request_id}.prompt"
    model = {"model": fields["model"]} if fields.get("model") else {}
    try:
        await state.client.submit(request_id=text_id, queue=queue, stream=False,
                                  task="detokenize", prompt_token_ids=fields["prompt_token_ids"],
                                  **model)
        async with following(state, text_id) as events:
            async for followed in events:
                if isinstance(followed.event, Done):
                    return followed.event.text
                if isinstance(followed.event, Error):
                    break
    except LLMQError:  # NOTE: the completion itself then fails the same way, and says so
        pass
    return ""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")
