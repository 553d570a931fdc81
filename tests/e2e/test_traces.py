"""OpenTelemetry traces across the queue: one request followed from its producer to the worker.

A real `llmq serve` (traced with `--otlp-traces-endpoint`) and a real `llmq worker` (traced by
the standard OTEL_EXPORTER_OTLP_ENDPOINT variable) send their spans over OTLP/HTTP to a collector
in this process (tests/fixtures/otlp_collector.py), which decodes the protobuf as a real one
does. With nothing configured, no process loads the trace SDK or an exporter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.e2e.cli_harness import LLMQ, llmq, one_error_line, subprocess_env
from tests.e2e.gateway_harness import KEYS, GatewayProcess
from tests.fixtures.otlp_collector import CollectedSpan, OtlpCollector
from tests.integration.worker_harness import WorkerProcess

pytestmark = pytest.mark.redis

PHASES = ["queue_wait", "admission", "prefill", "decode", "result_write"]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    with OtlpCollector() as collector:
        yield collector


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory,
         collector: OtlpCollector) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("traces")
    # NOTE: a short export delay, so spans arrive within the test rather than every 5 s.
    traced = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    saved = dict(os.environ)
    os.environ.update({**traced, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint})
    try:
        worker = WorkerProcess(valkey_server.url, tiny_model_path, logs, "traced-w1").start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    client = redis.Redis.from_url(valkey_server.url)
    try:
        worker.wait_ready(client)
    finally:
        client.close()
    gateway = GatewayProcess(valkey_server.url, logs, env=traced, extra=[
        "--otlp-traces-endpoint", collector.endpoint])
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        worker.stop()


def _trace(spans: list[CollectedSpan], trace_id: str) -> list[CollectedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def _one(spans: list[CollectedSpan], name: str) -> CollectedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def _has_worker_spans(trace_id: str) -> object:
    return lambda spans: {"llm_request", *PHASES} <= {s.name for s in _trace(spans, trace_id)}


def test_one_trace_follows_a_chat_request_from_the_gateway_through_the_worker(
        pool: GatewayProcess, collector: OtlpCollector) -> None:
    # Given a caller whose own trace context goes in the W3C header
    traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    # When it asks the traced gateway for a streamed chat completion
    with httpx.stream("POST", f"{pool.base_url}/v1/chat/completions", timeout=60.0, headers={
            "Authorization": f"Bearer {KEYS['alice']}", "traceparent": traceparent}, json={
            "model": "tiny-llama.gguf", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        public_id = response.headers["x-request-id"]
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    # Then one trace, the caller's, holds the gateway's span and the worker's spans
    spans = _trace(collector.wait_for(_has_worker_spans(CALLER_TRACE),
                                      "worker spans in the caller's trace"), CALLER_TRACE)
    spans = _trace(collector.wait_for(lambda s: any(
        x.service == "llmq-gateway" and x.kind == "SERVER" for x in _trace(s, CALLER_TRACE)),
        "the gateway's span"), CALLER_TRACE)
    http = _one(spans, "POST /v1/chat/completions")
    submit = _one(spans, "submit")
    request = _one(spans, "llm_request")
    assert {http.service, submit.service, request.service} == {"llmq-gateway", "llmq-worker"}
    # And the parents link caller -> gateway -> submit (PRODUCER) -> llm_request (CONSUMER)
    assert (http.kind, http.parent_id) == ("SERVER", CALLER_SPAN)
    assert (submit.kind, submit.service, submit.parent_id) == ("PRODUCER", "llmq-gateway",
                                                               http.span_id)
    assert (request.kind, request.service, request.parent_id) == ("CONSUMER", "llmq-worker",
                                                                  submit.span_id)
    # And every phase is a child of llm_request, in order, within it
    phases = [_one(spans, name) for name in PHASES]
    assert all(p.parent_id == request.span_id and p.service == "llmq-worker" for p in phases)
    starts = [p.start_ns for p in phases]
    assert starts == sorted(starts)
    assert request.start_ns <= starts[0] and phases[-1].end_ns <= request.end_ns
    # And the attributes are vLLM's names, with the figures the client saw
    attrs = request.attributes
    assert attrs["gen_ai.request.id"] == f"alice:{public_id}"
    assert http.attributes["gen_ai.request.id"] == public_id
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert attrs["gen_ai.response.model"] == "tiny-llama.gguf"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]
    assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert http.attributes["http.response.status_code"] == 200


def test_llmq_submit_starts_a_trace_the_worker_joins(
        pool: GatewayProcess, valkey_server, collector: OtlpCollector) -> None:
    # Given a producer traced by the standard variable alone (no flag, no gateway)
    env = subprocess_env(valkey_server.url, OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                         OTEL_BSP_SCHEDULE_DELAY="100", OTEL_SERVICE_NAME="my-producer")
    # When `llmq submit` sends a request and waits for its answer
    done = subprocess.run([*LLMQ, "submit", "Hello", "--id", "traced-cli-1", "--max-tokens",
                           "3", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Then its `submit` span is the root of a trace whose llm_request is the worker's
    spans = collector.wait_for(lambda s: any(
        x.name == "llm_request" and x.attributes.get("gen_ai.request.id") == "traced-cli-1"
        for x in s), "the worker's span of traced-cli-1")
    request = next(s for s in spans if s.name == "llm_request"
                   and s.attributes["gen_ai.request.id"] == "traced-cli-1")
    submit = next(s for s in spans if s.span_id == request.parent_id)
    assert (submit.service, submit.kind, submit.parent_id) == ("my-producer", "PRODUCER", "")
    assert submit.attributes["gen_ai.request.id"] == "traced-cli-1"
    assert submit.trace_id == request.trace_id


def test_a_producer_s_own_traceparent_is_carried_as_given(
        pool: GatewayProcess, valkey_server, collector: OtlpCollector) -> None:
    # Given a producer that does not trace but sets the wire field itself
    from llmq.broker.client import Client

    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with Client(valkey_server.url) as client:
        client.submit("Hello", request_id="own-traceparent", max_tokens=2,
                      traceparent=f"00-{trace_id}-{parent}-01")
    # Then the worker's span joins that trace under that parent
    spans = collector.wait_for(_has_worker_spans(trace_id), "the worker's spans")
    assert _one(_trace(spans, trace_id), "llm_request").parent_id == parent


def test_each_request_of_a_pipelined_submit_gets_its_own_trace(
        pool: GatewayProcess, valkey_server, collector: OtlpCollector) -> None:
    # Given a traced producer (this process) sending three requests in one round trip, as
    # file, batch and dataset jobs do
    from llmq.broker import tracing
    from llmq.broker.client import Client

    tracing.configure("many-producer", collector.endpoint, env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        with Client(valkey_server.url) as client:
            ids = client.submit_many([{"id": f"many-{i}", "prompt": "Hi", "max_tokens": 2}
                                      for i in range(3)])
    finally:
        tracing.shutdown()  # exports what is buffered
    # Then each has its own trace: its `submit` span, parent of the worker's llm_request
    spans = collector.wait_for(lambda s: {f"many-{i}" for i in range(3)} <= {
        x.attributes.get("gen_ai.request.id") for x in s if x.name == "llm_request"},
        "the worker's spans of the three requests")
    submits = {s.attributes["gen_ai.request.id"]: s for s in spans
               if s.name == "submit" and s.service == "many-producer"}
    requests = {s.attributes["gen_ai.request.id"]: s for s in spans if s.name == "llm_request"}
    assert len({submits[i].trace_id for i in ids}) == 3
    assert all(requests[i].parent_id == submits[i].span_id for i in ids)


def test_a_request_refused_at_admission_ends_its_trace_with_the_error(
        pool: GatewayProcess, valkey_server, collector: OtlpCollector) -> None:
    # Given a request the wire accepts but the model cannot run (a token id past its vocabulary)
    from llmq.broker.client import Client

    trace_id, parent = "5af7651916cd43dd8448eb211c80319c", "c7ad6b7169203331"
    with Client(valkey_server.url) as client:
        client.submit(prompt_token_ids=[2**31 - 1], request_id="refused-traced", max_tokens=2,
                      traceparent=f"00-{trace_id}-{parent}-01")
    # Then its trace ends at admission: llm_request in error, with the code, no engine phase
    spans = _trace(collector.wait_for(lambda s: {"llm_request", "admission"} <= {
        x.name for x in _trace(s, trace_id)}, "the refused request's spans"), trace_id)
    request = _one(spans, "llm_request")
    assert request.status_code == 2 and request.attributes["error.type"] == "invalid_token_id"
    assert sorted(s.name for s in spans if s.parent_id == request.span_id) == [
        "admission", "queue_wait", "result_write"]


@pytest.mark.parametrize("command", [["serve", "--no-auth"], ["up"]])
def test_a_collector_url_that_cannot_work_is_a_one_line_error_at_start(
        command: list[str], tmp_path: Path) -> None:
    # When the gateway, or `llmq up` for its workers, is given an endpoint that is no URL
    result = llmq(*command, "--otlp-traces-endpoint", "collector:4318",
                  env={"OTEL_EXPORTER_OTLP_PROTOCOL": None, "LLMQ_RUN_DIR": str(tmp_path)})
    # Then it says which flag and why, and nothing starts
    line = one_error_line(result)
    assert "--otlp-traces-endpoint 'collector:4318'" in line and "http(s) URL" in line


def test_with_nothing_configured_no_process_loads_opentelemetry(
        valkey_server, tmp_path: Path) -> None:
    # Given a process with no OTEL_* variable and no flag
    env = {k: v for k, v in subprocess_env(valkey_server.url).items()
           if not k.startswith("OTEL_")}
    script = """
import json
import sys
import threading
from llmq.broker import tracing
from llmq.broker.client import Client
from llmq.gateway.app import create_app
from llmq.gateway.settings import GatewaySettings
from llmq.gateway.api_keys import ApiKeys
from llmq.broker.settings import BrokerSettings
from llmq.worker.request_spans import RequestSpans

with Client(sys.argv[1]) as client:
    client.submit("Hello", request_id="untraced-1", max_tokens=1)
app = create_app(GatewaySettings(ApiKeys.parse((), anonymous=True), BrokerSettings.from_env()))
print(json.dumps({
    "tracing": repr(tracing.current()), "spans": repr(RequestSpans.for_process("d", "w", "m")),
    "middleware": [m.cls.__name__ for m in app.user_middleware],
    "threads": [t.name for t in threading.enumerate()],
    # NOTE: redis-py 8 itself imports opentelemetry's metrics API when it is installed: what
    # must stay out is the trace SDK and the exporter.
    "modules": sorted(m for m in sys.modules
                      if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter")))}))
"""
    # When it submits a request and builds a gateway and a worker's span hook
    done = subprocess.run([sys.executable, "-c", script, valkey_server.url], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Then tracing is off everywhere: the gateway has no tracing middleware, the trace SDK and
    # the exporter were never imported, no exporter thread runs
    seen = json.loads(done.stdout)
    assert (seen["tracing"], seen["spans"]) == ("None", "None")
    assert "TracedRequests" not in seen["middleware"]
    assert seen["modules"] == []
    assert not [name for name in seen["threads"] if "Otel" in name]
    # And the request went out without a traceparent
    entries = redis.Redis.from_url(valkey_server.url).xrange("llmq:q:{default}")
    payloads = [fields[b"json"] for _, fields in entries if b"untraced-1" in fields[b"json"]]
    assert payloads and all(b"traceparent" not in p for p in payloads)
