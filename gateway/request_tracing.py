"""TracedRequests: one OpenTelemetry SERVER span per API request, the trace's gateway end.

Added by create_app only when the process traces (broker/tracing.py): a gateway that does not
trace runs without this middleware at all. The span continues the caller's trace when the HTTP
request carries a W3C `traceparent` header (as vLLM's OpenAI server and llm-d's router pass it
on), and is the current span while the route runs, so `AsyncClient.submit` parents its `submit`
span on it and the request the worker reads carries that trace (protocol/requests.py,
`traceparent`). It ends when the response has been sent, the last streamed event included.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmq.broker import tracing
from llmq.broker.tracing import Tracing

__all__ = ["TracedRequests"]

# NOTE: the API only: the dashboard's polling and /metrics scrapes would bury requests in noise.
TRACED_PREFIX = "/v1/"


class TracedRequests:
    def __init__(self, app: ASGIApp, tracing_: Tracing) -> None:
        self.app = app
        self.tracing = tracing_

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PREFIX):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        method = scope["method"]
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": scope["path"]}
        parent = self.tracing.context_of(_traceparent(scope))
        with self.tracing.tracer.start_as_current_span(
                f"{method} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                attributes=attributes) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                    for name, value in message.get("headers", []):
                        if name.lower() == b"x-request-id":
                            span.set_attribute(tracing.REQUEST_ID, value.decode("latin-1"))
                await send(message)

            await self.app(scope, receive, send_traced)
            # NOTE: named after the route once routing found it (`/v1/completions/{request_id}/
            # stream`), so span names stay few whatever the ids.
            if (route := getattr(scope.get("route"), "path", None)) is not None:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)


def _traceparent(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"traceparent":
            return str(value.decode("latin-1"))
    return None
