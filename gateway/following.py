"""Following a request's events for an HTTP answer: until the worker admits it (a stream's
status waits for that), with followers closed however the answer ends, and a dropped stream's
request cancelled only after a grace period unless it is resumed by then.

Used by the completion routes (gateway/completions.py) and the Responses API
(gateway/responses.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from llmq.broker.commands import Followed
from llmq.gateway.openai_response import error_body, error_status
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol import Done, Error, Start
from llmq.protocol.errors import LLMQError, ResultTimeout

__all__ = ["GONE", "admission", "cancel_unless_resumed", "close_follower", "disconnected",
           "following", "in_background", "openai_code", "timeout_body", "unless_client_gone"]

T = TypeVar("T")


class _Gone:
    """What `unless_client_gone` returns when the client went away first."""


GONE = _Gone()


def openai_code(code: str) -> str:
    return "context_length_exceeded" if code == "prompt_too_long" else code


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_client_gone(request: Request, work: Awaitable[T]) -> T | _Gone:
    """`work`'s result, or GONE when the client went away first (`work` is cancelled then; the
    request it followed is the caller's to cancel or keep)."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if answer.done() and not answer.cancelled():
        return answer.result()
    answer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await answer
    return GONE


@contextlib.asynccontextmanager
async def following(state: GatewayState, request_id: str, after: str | None = None,
                    events: AsyncIterator[Followed] | None = None
                    ) -> AsyncGenerator[AsyncIterator[Followed], None]:
    """The request's events (`events` when already open), closed on leaving, however that
    happens: its follower unsubscribes at once rather than whenever the garbage collector
    finalizes the generator."""
    if events is None:
        events = state.client.follow(request_id, timeout=state.settings.request_timeout,
                                     after=after)
    try:
        yield events
    except BaseException:
        await close_follower(events)
        raise
    # NOTE: closing a follower can wait for the reader's blocking read to return (seconds):
    # after a terminal event the response ends first, and the follower closes behind it.
    in_background(close_follower(events))


async def close_follower(events: AsyncIterator[Followed]) -> None:
    # NOTE: AsyncClient.follow is an async generator, though typed as an AsyncIterator.
    if isinstance(events, AsyncGenerator):
        await events.aclose()


_background: set[asyncio.Task[None]] = set()  # held, so the loop does not drop them unrun


def in_background(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def cancel_unless_resumed(state: GatewayState, request_id: str, queue: str,
                                grace: float) -> None:
    """Cancel a request whose stream dropped, unless it is resumed within `grace` seconds."""
    dropped = time.time()
    await asyncio.sleep(grace)
    options = await state.stream_options(request_id) or {}
    if float(options.get("resumed") or 0) >= dropped:
        return
    state.metrics.cancelled.inc()
    await state.cancel(request_id, queue)


async def admission(state: GatewayState, request: Request, request_id: str, queue: str,
                    keep: bool, events: AsyncIterator[Followed]) -> list[Followed] | Response:
    """The events up to the worker's admission (`start`, or the error refusing the request),
    so a stream's HTTP status says whether it runs, as OpenAI's and vLLM's do: the events read,
    or the error Response (a refusal, a timeout, a client gone meanwhile)."""
    read: list[Followed] = []

    async def admitted() -> Response | None:
        try:
            async for followed in events:
                read.append(followed)
                event = followed.event
                if isinstance(event, Error):
                    status, kind = error_status(event.code)
                    return json_response(error_body(event.message, kind,
                                                    openai_code(event.code)), status)
                if isinstance(event, Start | Done):
                    return None
        except ResultTimeout:
            return json_response(timeout_body(state), 504)
        except LLMQError as exc:
            return json_response(error_body(str(exc), "server_error", "broker_unavailable"),
                                 503)
        raise AssertionError("follow() ends only after a terminal event")

    outcome = await unless_client_gone(request, admitted())
    if isinstance(outcome, _Gone):
        if not keep and not state.shutting_down():
            await state.cancel(request_id, queue)
        return Response(status_code=499)  # nobody is there to read it
    return outcome or read


def timeout_body(state: GatewayState) -> dict[str, Any]:
    return error_body(f"no answer within the gateway's request timeout "
                      f"({state.settings.request_timeout:g}s)", "server_error", "timeout")
