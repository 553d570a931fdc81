"""Tracing: a process's OpenTelemetry spans, off unless configured, and the W3C `traceparent`.

One request is followed across processes as in vLLM and llm-d: the producer (`Client.submit`,
the gateway behind it) opens a span and puts its W3C trace context in the request's optional
`traceparent` field (docs/protocol.md); the worker that runs it parents its spans on that value
(worker/request_spans.py). Spans go out over OTLP/HTTP (protobuf) in batches, off the caller's
thread.

Off unless configured, with the standard variables or `--otlp-traces-endpoint` (vLLM's flag):

- `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`: off, whatever else is set;
- an endpoint: the flag, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full URL, `/v1/traces`
  included) or `OTEL_EXPORTER_OTLP_ENDPOINT` (a base URL, `/v1/traces` appended): on;
- `OTEL_TRACES_EXPORTER=otlp` alone: on, to the exporter's default (http://localhost:4318).

Everything else the SDK reads from the environment still applies (`OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER`, `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_HEADERS`...).

NOTE: the trace SDK and the exporter are imported only once tracing is on: with nothing
configured no exporter or export thread exists and the hot paths pay one `is None` test
(tests/e2e/test_traces.py checks it). They come with the `otel` extra (pyproject.toml).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Tracing", "TracingUnavailable", "configure", "current", "shutdown",
           "submit_traceparent"]

logger = logging.getLogger(__name__)

TRACER_NAME = "llmq"
DEFAULT_SERVICE_NAME = "llmq"
TRACES_PATH = "/v1/traces"

# Attribute names after vLLM's (vllm/tracing.py, SpanAttributes) where it has one, and
# OpenTelemetry's messaging conventions for the queue.
REQUEST_ID = "gen_ai.request.id"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
MESSAGING_SYSTEM = "messaging.system"


class TracingUnavailable(ValueError):
    """Tracing was asked for but cannot start (a bad setting, or the `otel` extra missing)."""


def _enabled_endpoint(endpoint: str | None, env: Mapping[str, str]) -> tuple[bool, str | None]:
    """(whether tracing is on, the endpoint to give the exporter; None: the exporter's own
    reading of the environment)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False, None
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if e.strip()}
    if "none" in exporters:
        return False, None
    if exporters - {"otlp"}:
        raise TracingUnavailable(
            f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: llmq exports traces over "
            "OTLP/HTTP only; set it to `otlp` or `none`")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if env.get(name, "http/protobuf") != "http/protobuf":
            # NOTE: a gRPC collector (port 4317, vLLM's default) would refuse every export
            # silently: say so at start.
            raise TracingUnavailable(f"{name}={env[name]!r}: llmq exports traces over "
                                     "OTLP/HTTP (http/protobuf, port 4318) only")
    if endpoint:
        return True, traces_url(endpoint)
    named = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                 or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return named or "otlp" in exporters, None


def traces_url(endpoint: str) -> str:
    """`--otlp-traces-endpoint`: a full URL; a bare `http://host:4318` gets `/v1/traces`."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TracingUnavailable(f"--otlp-traces-endpoint {endpoint!r}: give an http(s) URL of "
                                 "an OTLP/HTTP collector, e.g. http://localhost:4318/v1/traces")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH


@dataclass
class Tracing:
    """The process's tracer and its provider (which owns the exporter's thread)."""

    tracer: Any  # opentelemetry.trace.Tracer
    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    service_name: str

    def context_of(self, traceparent: str | None) -> Any:
        """The OpenTelemetry context a W3C `traceparent` names (an empty one for None)."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {"traceparent": traceparent} if traceparent else {}
        return TraceContextTextMapPropagator().extract(carrier)

    def traceparent_of(self, span: Any) -> str | None:
        """The W3C `traceparent` of `span`, for a request it sends on."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def flush(self, timeout_ms: int = 5_000) -> None:
        self.provider.force_flush(timeout_ms)


_lock = threading.Lock()
_state: dict[str, Tracing | None] = {}  # "current": the process's, once decided


def configure(service_name: str = DEFAULT_SERVICE_NAME, endpoint: str | None = None,
              env: Mapping[str, str] | None = None) -> Tracing | None:
    """Decide once for this process whether it traces (see the module docstring); the
    `Tracing`, or None when off. `OTEL_SERVICE_NAME` wins over `service_name`.

    Raises TracingUnavailable for a setting that cannot work (naming it), or when tracing is
    asked for and the `otel` extra is not installed."""
    env = os.environ if env is None else env
    on, url = _enabled_endpoint(endpoint, env)
    with _lock:
        old = _state.get("current")
        if old is not None:
            old.provider.shutdown()
        _state["current"] = _start(env.get("OTEL_SERVICE_NAME") or service_name, url) if on \
            else None
        return _state["current"]


def _start(service_name: str, url: str | None) -> Tracing:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"tracing is configured but OpenTelemetry is not installed ({exc.name}): "
            "pip install 'llmq[otel]'") from None
    # NOTE: a provider of our own, not the global one: the process's other instrumentation (if
    # any) keeps its own, and a test can configure again.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    logger.info("tracing on: service %s, OTLP/HTTP to %s", service_name,
                url or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "the default endpoint")
    return Tracing(provider.get_tracer(TRACER_NAME), provider, service_name)


def current() -> Tracing | None:
    """The process's tracing; decided from the environment on first use when no entry point
    configured it (a producer such as `llmq submit` or a library user). None when off."""
    try:
        return _state["current"]
    except KeyError:
        pass
    try:
        return configure()
    except TracingUnavailable as exc:
        logger.warning("tracing off: %s", exc)
        with _lock:
            _state["current"] = None
        return None


def shutdown() -> None:
    """Export what is buffered and stop (before a process ends with os._exit)."""
    with _lock:
        tracing = _state.get("current")
        if tracing is not None:
            tracing.provider.shutdown()
        _state["current"] = None


def submit_traceparent(request_id: str | None, params: Mapping[str, Any]) -> str | None:
    """The `traceparent` a producer puts in a request it is about to send: that of a PRODUCER
    span `submit`, child of the caller's current span (the gateway's HTTP span), recorded at
    once (the message's creation, as OpenTelemetry's messaging conventions call it). None when
    tracing is off or the request carries a `traceparent` already (it then continues the
    caller's trace as given)."""
    tracing = current()
    if tracing is None or params.get("traceparent"):
        return None
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {MESSAGING_SYSTEM: "llmq"}
    if request_id:
        attributes[REQUEST_ID] = request_id
    if isinstance(model := params.get("model"), str):
        attributes[REQUEST_MODEL] = model
    span = tracing.tracer.start_span("submit", kind=SpanKind.PRODUCER, attributes=attributes)
    span.end()
    return tracing.traceparent_of(span)
