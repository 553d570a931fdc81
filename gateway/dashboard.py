"""The dashboard's routes: a page for people, and the small JSON/SSE API it polls.

    GET  /dashboard                               the page (the login form without a session)
    POST /dashboard/login | /dashboard/logout     an API key -> the session cookie, and back
    GET  /dashboard/static/{name}                 the page's CSS and JavaScript (package data)
    GET  /dashboard/api/pool                      queues and workers (every 2 s)
    GET  /dashboard/api/dead-letters              the newest dead letters in reach
    GET  /dashboard/api/series?since=<ms>         chart samples of the last hour (PoolSeries)
    GET  /dashboard/api/jobs                      batches and dataset jobs in reach (JobsView)
    POST /dashboard/api/dead-letters/{queue}/{dlq_entry_id}/retry
    POST /dashboard/api/dead-letters/{queue}/purge
    GET  /dashboard/api/requests/{request_id}/events   one request's events, live (SSE)
    POST /dashboard/api/requests/{request_id}/cancel

Plain HTML, CSS and JavaScript shipped in the package (gateway/static/): no build step, no CDN,
nothing fetched from elsewhere, so it works offline and its Content-Security-Policy allows this
origin only. Who sees what, and how the session and its POSTs are protected:
gateway/dashboard_session.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from functools import cache
from importlib import resources

import msgspec
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from llmq.broker.exchange import send_async
from llmq.broker.multiplex import parse_entry_id
from llmq.broker.request_lookup import RequestLookup
from llmq.broker.transcript import Fold
from llmq.gateway.dashboard_session import (
    Viewer,
    check_post,
    clear_cookie,
    end_session,
    same_origin,
    set_cookie,
    start_session,
    viewer_of,
)
from llmq.gateway.dead_letter_view import DeadLetterView
from llmq.gateway.errors import APIError, bad_request, not_found
from llmq.gateway.jobs_view import JobsView
from llmq.gateway.openai_response import sse
from llmq.gateway.pool_series import RATE_WINDOW_S
from llmq.gateway.state import GatewayState, json_response
from llmq.protocol import Delta
from llmq.protocol.errors import LLMQError, ResultTimeout

__all__ = ["ROUTES"]

_STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make Origin `null`
    "Cache-Control": "no-store",
}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Heartbeat fields the page has no use for (the charts get percentiles from the gateway).
_HISTOGRAM_FIELDS = ("ttft_hist", "queue_hist", "ttft_admitted_hist", "itl_hist", "e2e_hist")
STALE_AFTER_S = 25.0  # a heartbeat this old is shown as stale (renewals come every ~10 s)


@cache
def _asset(name: str) -> bytes:
    return resources.files("llmq.gateway").joinpath("static", name).read_bytes()


def _page(name: str, **values: str) -> Response:
    text = _asset(name).decode()
    for placeholder, value in values.items():
        text = text.replace("{{" + placeholder + "}}", value)
    return Response(text, headers=_SECURITY_HEADERS, media_type="text/html")


async def _viewer(request: Request) -> tuple[GatewayState, Viewer]:
    state = GatewayState.of(request)
    viewer = await viewer_of(request, state)
    if viewer is None:
        raise APIError(401, "sign in to the dashboard (or send Authorization: Bearer <key>)",
                       "invalid_request_error", code="invalid_api_key")
    if request.method == "POST":
        check_post(request, viewer)
    return state, viewer


# -- the page and its session ---------------------------------------------------------------------


async def page(request: Request) -> Response:
    state = GatewayState.of(request)
    viewer = await viewer_of(request, state)
    if viewer is None:
        error = "Unknown API key." if request.query_params.get("error") else ""
        return _page("login.html", error=error)
    return _page("dashboard.html", csrf=viewer.csrf_token)


async def login(request: Request) -> Response:
    state = GatewayState.of(request)
    if not same_origin(request):
        raise APIError(403, "cross-origin login refused", "invalid_request_error",
                       code="forbidden")
    key = str((await request.form()).get("key") or "").strip()
    if not key or state.settings.api_keys.tenant(f"Bearer {key}") is None:
        return RedirectResponse("/dashboard?error=1", 303)
    response = RedirectResponse("/dashboard", 303)
    set_cookie(response, request, await start_session(state, key))
    return response


async def logout(request: Request) -> Response:
    state, _ = await _viewer(request)
    await end_session(request, state)
    response = json_response({"signed_out": True})
    clear_cookie(response, request)
    return response


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _STATIC:
        raise not_found(f"no file {name!r:.60}")
    return Response(_asset(name), media_type=_STATIC[name],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


# -- what the page polls --------------------------------------------------------------------------


async def pool(request: Request) -> Response:
    state, viewer = await _viewer(request)
    names = await state.client.queues()
    if state.settings.broker.queue not in names:
        names.append(state.settings.broker.queue)  # the configured queue, even before it exists
    names.sort()
    stats = await asyncio.gather(*(state.client.stats(name) for name in names))
    lane_stats = await asyncio.gather(*(state.client.lane_stats(name) for name in names))
    rates = state.series.rates()
    beats = await state.pool.workers()
    # NOTE: consumers counted are live workers (a heartbeat): the group keeps a stopped
    # worker's name until a peer's reclaimer removes it.
    live = collections.Counter(w.queue for w in beats)
    queues = []
    for s in stats:
        rate = rates.get(s.queue)
        # NOTE: the pool's prefix-cache hit rate: every live worker's prompt tokens together
        # (what cache affinity across workers raises: worker/affinity_keeper.py).
        prompt = sum(w.prompt_tokens_total for w in beats if w.queue == s.queue)
        cached = sum(w.cached_prompt_tokens_total for w in beats if w.queue == s.queue)
        queues.append({"queue": s.queue, "length": s.length, "lag": s.lag, "pending": s.pending,
                       "dead_letters": s.dead_letters, "consumers": live[s.queue],
                       "tokens_per_s": round(rate.tokens_per_s, 2) if rate else 0.0,
                       "requests_per_s": round(rate.requests_per_s, 3) if rate else 0.0,
                       "prefix_hit_rate": round(cached / prompt, 4) if prompt else None})
    # NOTE: a tenant sees the shared lanes and its own, not which other tenants queue what.
    lanes = [{"queue": s.queue, "lane": s.lane, "backlog": s.backlog, "pending": s.pending,
              "done": s.done} for per_queue in lane_stats for s in per_queue
             if viewer.admin or s.tenant in (None, viewer.tenant)]
    now = time.time()
    workers = []
    for w in sorted(beats, key=lambda w: (w.queue, w.worker_id)):
        row = msgspec.structs.asdict(w)
        # NOTE: hosts and pids are the operators' business, not a tenant's.
        for name in _HISTOGRAM_FIELDS + (() if viewer.admin else ("host", "pid")):
            row.pop(name, None)
        row["heartbeat_age_s"] = round(max(0.0, now - w.heartbeat_ms / 1000), 1)
        workers.append(row)
    return json_response({
        "viewer": {"tenant": viewer.tenant, "admin": viewer.admin}, "now_ms": int(now * 1000),
        "stale_after_s": STALE_AFTER_S, "rate_window_s": RATE_WINDOW_S, "queues": queues,
        "lanes": lanes, "workers": workers},
        headers={"Cache-Control": "no-store"})


async def dead_letters(request: Request) -> Response:
    """Asked for when a queue's dead-letter count changes (and now and then), not every poll:
    a dead letter keeps its payload, up to 1 MiB."""
    state, viewer = await _viewer(request)
    rows = await DeadLetterView(state.client).list(viewer, await state.client.queues())
    return json_response({"dead_letters": rows}, headers={"Cache-Control": "no-store"})


async def series(request: Request) -> Response:
    state, _ = await _viewer(request)
    try:
        since = int(request.query_params.get("since", "0"))
    except ValueError:
        raise bad_request("since must be a unix time in ms", "since") from None
    samples = await state.series.read(since)
    return json_response({"interval_s": state.settings.dashboard_interval,
                          "rate_window_s": RATE_WINDOW_S,
                          "samples": [msgspec.structs.asdict(s) for s in samples]},
                         headers={"Cache-Control": "no-store"})


async def jobs(request: Request) -> Response:
    state, viewer = await _viewer(request)
    return json_response(await JobsView(state).read(viewer), headers={"Cache-Control": "no-store"})


# -- dead letters ---------------------------------------------------------------------------------


async def retry_dead_letter(request: Request) -> Response:
    state, viewer = await _viewer(request)
    queue, entry_id = request.path_params["queue"], request.path_params["dlq_entry_id"]
    new_entry_id = await DeadLetterView(state.client).retry(viewer, queue, entry_id)
    return json_response({"queue": queue, "requeued": entry_id, "entry_id": new_entry_id})


async def purge_dead_letters(request: Request) -> Response:
    state, viewer = await _viewer(request)
    queue = request.path_params["queue"]
    removed = await DeadLetterView(state.client).purge(viewer, queue)
    return json_response({"queue": queue, "purged": removed})


# -- the request inspector ------------------------------------------------------------------------


async def request_events(request: Request) -> Response:
    state, viewer = await _viewer(request)
    request_id = viewer.request_id(request.path_params["request_id"])
    after = request.headers.get("last-event-id")
    if after is not None:
        try:
            parse_entry_id(after)
        except ValueError:
            raise bad_request(f"Last-Event-ID {after!r:.60} is not an event id",
                              "Last-Event-ID") from None
    return StreamingResponse(_inspect(state, viewer, request_id, after), headers=_SSE_HEADERS,
                             media_type="text/event-stream")


async def _inspect(state: GatewayState, viewer: Viewer, request_id: str, after: str | None
                   ) -> AsyncIterator[bytes]:
    """The request's events as they come, each an SSE frame with its result stream entry id
    (so the browser's reconnect resumes after it); a note first when nothing is known yet."""
    yield b": llmq\n\n"  # headers out at once: the page shows it is connected
    if after is None and not await _known(state, request_id):
        yield sse({"type": "unknown"})
    shown = viewer.shown_id(request_id)
    try:
        # NOTE: closed here at once when the browser goes, not whenever it is collected.
        follow = state.client.follow(request_id, timeout=state.settings.request_timeout,
                                     after=after)
        async with contextlib.aclosing(follow) as events:
            async for followed in events:
                if followed.replayed:
                    continue
                event = msgspec.to_builtins(followed.event)
                event["request_id"] = shown
                if isinstance(followed.event, Delta):
                    event.pop("token_ids", None)
                    event.pop("logprobs", None)
                event["restarted"] = followed.fold is Fold.RESTARTED
                yield sse(event, followed.entry_id)
    except ResultTimeout:
        yield sse({"type": "gone", "message": "no more events within the gateway's request "
                   f"timeout ({state.settings.request_timeout:g} s)"})
    except LLMQError as exc:
        yield sse({"type": "gone", "message": str(exc)})


async def _known(state: GatewayState, request_id: str) -> bool:
    """Whether the request has events or was submitted with this id (its idempotency marker
    on any queue: an id alone does not say which queue it went to)."""
    return await send_async(state.client, RequestLookup(state.keys).known(
        request_id, await state.queues()))


async def cancel_request(request: Request) -> Response:
    state, viewer = await _viewer(request)
    request_id = viewer.request_id(request.path_params["request_id"])
    await state.cancel_everywhere(request_id)
    return json_response({"request_id": viewer.shown_id(request_id), "cancelled": True})


ROUTES = [
    Route("/dashboard", page, methods=["GET"]),
    Route("/dashboard/login", login, methods=["POST"]),
    Route("/dashboard/logout", logout, methods=["POST"]),
    Route("/dashboard/static/{name}", static, methods=["GET"]),
    Route("/dashboard/api/pool", pool, methods=["GET"]),
    Route("/dashboard/api/series", series, methods=["GET"]),
    Route("/dashboard/api/dead-letters", dead_letters, methods=["GET"]),
    Route("/dashboard/api/jobs", jobs, methods=["GET"]),
    Route("/dashboard/api/dead-letters/{queue}/{dlq_entry_id}/retry", retry_dead_letter,
          methods=["POST"]),
    Route("/dashboard/api/dead-letters/{queue}/purge", purge_dead_letters, methods=["POST"]),
    Route("/dashboard/api/requests/{request_id}/events", request_events, methods=["GET"]),
    Route("/dashboard/api/requests/{request_id}/cancel", cancel_request, methods=["POST"]),
]
