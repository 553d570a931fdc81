"""When a process traces (broker/tracing.py), and the wire's `traceparent` field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmq.broker import tracing
from llmq.protocol.errors import InvalidRequest
from llmq.protocol.requests import parse_request

ENDPOINT = "http://127.0.0.1:9/v1/traces"  # nothing listens: these tests export nothing


@pytest.fixture(autouse=True)
def fresh_tracing() -> Iterator[None]:
    yield
    tracing.shutdown()


@pytest.mark.parametrize("env", [
    {},
    {"OTEL_SERVICE_NAME": "x"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "true"},
])
def test_tracing_is_off_unless_configured(env: dict[str, str]) -> None:
    # Given no endpoint, or one switched off by the standard variables
    # Then the process does not trace
    assert tracing.configure("llmq-worker", env=env) is None
    assert tracing.current() is None


@pytest.mark.parametrize("env", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
    {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT},
    {"OTEL_TRACES_EXPORTER": "otlp"},
])
def test_an_endpoint_or_the_otlp_exporter_turns_tracing_on(env: dict[str, str]) -> None:
    on = tracing.configure("llmq-worker", env=env)
    assert on is not None and on.service_name == "llmq-worker"
    assert tracing.current() is on


def test_the_flag_turns_it_on_and_otel_service_name_wins() -> None:
    on = tracing.configure("llmq-gateway", "http://127.0.0.1:9",
                           env={"OTEL_SERVICE_NAME": "edge"})
    assert on is not None and on.service_name == "edge"


def test_a_bare_collector_url_gets_the_traces_path() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


@pytest.mark.parametrize(("endpoint", "env", "named"), [
    ("collector:4318", {}, "--otlp-traces-endpoint 'collector:4318'"),
    (None, {"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
    ("http://c:4317", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"),
])
def test_a_setting_that_cannot_work_is_a_clear_error(endpoint: str | None, env: dict[str, str],
                                                     named: str) -> None:
    with pytest.raises(tracing.TracingUnavailable, match=named):
        tracing.configure("llmq-worker", endpoint, env=env)


def test_a_traced_submit_gives_a_traceparent_unless_the_request_has_one() -> None:
    assert tracing.submit_traceparent("r1", {}) is None  # off: nothing
    tracing.configure("llmq", env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT})
    given = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert tracing.submit_traceparent("r1", {"traceparent": given}) is None
    made = tracing.submit_traceparent("r1", {})
    assert made is not None and parse_request(
        b'{"prompt": "x", "traceparent": "%s"}' % made.encode(), "json").traceparent == made


@pytest.mark.parametrize("value", [
    "4bf92f3577b34da6a3ce929d0e0e4736",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
])
def test_a_malformed_traceparent_is_refused_naming_the_field(value: str) -> None:
    payload = b'{"prompt": "x", "traceparent": %s}' % repr(value).replace("'", '"').encode()
    with pytest.raises(InvalidRequest, match=r"\$\.traceparent"):
        parse_request(payload.replace(b"\n", b"\\n"), "json")
