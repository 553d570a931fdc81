"""`--otlp-traces-endpoint` (vLLM's flag) of `llmq worker`, `llmq serve` and `llmq up`.

Tracing is off unless this flag or the standard `OTEL_*` variables configure it
(broker/tracing.py); the flag is an OTLP/HTTP collector's URL (`http://host:4318` gets
`/v1/traces`).
"""

from __future__ import annotations

import click

from llmq.broker import tracing

__all__ = ["otlp_traces_endpoint_option", "start_tracing", "traces_url"]

otlp_traces_endpoint_option = click.option(
    "--otlp-traces-endpoint", default=None, metavar="URL",
    help="Send OpenTelemetry traces of every request to this OTLP/HTTP collector (e.g. "
         "http://localhost:4318/v1/traces). Off by default; OTEL_EXPORTER_OTLP_ENDPOINT and "
         "the other OTEL_* variables work too.")


def start_tracing(service_name: str, endpoint: str | None) -> tracing.Tracing | None:
    """Configure the process's tracing; a setting that cannot work is a one-line error."""
    try:
        return tracing.configure(service_name, endpoint)
    except tracing.TracingUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def traces_url(endpoint: str) -> str:
    """The URL `endpoint` stands for, as the children of `llmq up` are given it."""
    try:
        return tracing.traces_url(endpoint)
    except tracing.TracingUnavailable as exc:
        raise click.ClickException(str(exc)) from None
