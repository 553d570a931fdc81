"""Resumable streams and disconnects through real `llmq serve` processes.

A slowed tiny-model worker (each engine step sleeps 15 ms) keeps requests running long enough to
cut a stream mid-answer; two gateway processes share the Redis, so a stream cut on one resumes on
the other.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from llmq.broker.keys import Keys
from llmq.protocol import Done, decode_event
from tests.e2e.cli_harness import serve
from tests.e2e.gateway_harness import KEYS, GatewayProcess, parse_sse
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {KEYS['alice']}"}
BODY = {"model": "tiny-llama.gguf", "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def gateways(valkey_server, tiny_model_path: Path, tmp_path_factory
             ) -> Iterator[tuple[GatewayProcess, GatewayProcess, redis.Redis]]:
    logs = tmp_path_factory.mktemp("gateway-streams")
    worker = serve(valkey_server.url, tiny_model_path, logs, "gw-streams-w1",
                   fault="slow_step:15")
    first = GatewayProcess(valkey_server.url, logs, name="gateway-1")
    # NOTE: the second gateway waits 1 s for a dropped stream to resume, the first 30 s.
    second = GatewayProcess(valkey_server.url, logs, name="gateway-2",
                            extra=["--disconnect-grace", "1"])
    r = redis.Redis.from_url(valkey_server.url)
    try:
        yield first.start(), second.start(), r
    finally:
        r.close()
        first.stop()
        second.stop()
        worker.stop()


def iter_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """The SSE events of a streaming response, as they arrive."""
    buffer = ""
    for text in response.iter_text():
        buffer += text
        while "\n\n" in buffer:
            block, buffer = buffer.split("\n\n", 1)
            yield from parse_sse(block + "\n\n")


def read_events(response: httpx.Response, limit: int | None = None
                ) -> list[tuple[str | None, str]]:
    """Read SSE events off a streaming response, stopping after `limit` of them."""
    return list(itertools.islice(iter_events(response), limit))


def text_of(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            chunk = json.loads(data)
            out += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    return "".join(out)


def uncut(gateway: GatewayProcess, request_id: str) -> list[tuple[str | None, str]]:
    return uncut_body(gateway, request_id, BODY)


def uncut_body(gateway: GatewayProcess, request_id: str, body: dict
               ) -> list[tuple[str | None, str]]:
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                      headers={**AUTH, "X-Request-Id": request_id}, timeout=60) as response:
        assert response.status_code == 200
        return read_events(response)


def test_a_stream_cut_mid_answer_resumes_exactly_on_another_gateway(gateways) -> None:
    first, second, r = gateways
    whole = uncut(first, "whole-1")
    # Given a stream cut by the client after 5 events, asking to keep the request running
    with httpx.stream("POST", f"{first.base_url}/v1/chat/completions", json=BODY,
                      headers={**AUTH, "X-Request-Id": "cut-1", "X-Keep-On-Disconnect": "true"},
                      timeout=60) as response:
        assert response.headers["x-request-id"] == "cut-1"
        head = read_events(response, limit=5)
    last_id = [event_id for event_id, _ in head if event_id][-1]
    # When it reconnects to the other gateway with Last-Event-ID
    with httpx.stream("GET", f"{second.base_url}/v1/chat/completions/chatcmpl-cut-1/stream",
                      headers={**AUTH, "Last-Event-ID": last_id}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["x-request-id"] == "cut-1"
        tail = read_events(response)
    # Then it gets exactly the rest: the text adds up to an uncut run's, nothing twice
    assert text_of(head) + text_of(tail) == text_of(whole) and len(text_of(whole)) > 0
    ids = [event_id for event_id, _ in head + tail if event_id]
    assert len(ids) == len(set(ids)) and ids == sorted(ids, key=lambda i: tuple(
        map(int, i.split("-"))))
    assert len(head) + len(tail) == len(whole) and tail[-1][1] == "[DONE]"
    # And it ran once, to the end
    done = [decode_event(f) for _, f in r.xrange(Keys().result("alice:cut-1"))][-1]
    assert isinstance(done, Done) and done.finish_reason == "length"


def test_a_finished_request_can_be_resumed_from_any_event(gateways) -> None:
    first, second, _ = gateways
    whole = uncut(first, "finished-1")
    ids = [event_id for event_id, _ in whole if event_id]
    for k in (0, 3, len(ids) - 1):
        with httpx.stream("GET", f"{second.base_url}/v1/chat/completions/finished-1/stream",
                          params={"after": ids[k]}, headers=AUTH, timeout=60) as response:
            tail = read_events(response)
        head = whole[:whole.index(next(e for e in whole if e[0] == ids[k])) + 1]
        assert text_of(head) + text_of(tail) == text_of(whole)
        assert tail[-1][1] == "[DONE]"
    # From the start (no Last-Event-ID) it is the whole stream again
    with httpx.stream("GET", f"{second.base_url}/v1/chat/completions/finished-1/stream",
                      headers=AUTH, timeout=60) as response:
        assert read_events(response) == whole


def test_an_unknown_or_foreign_request_cannot_be_resumed(gateways) -> None:
    first, _, _ = gateways
    uncut(first, "mine-1")
    for key, path in ((KEYS["alice"], "nobody-1"), (KEYS["bob"], "mine-1")):
        response = httpx.get(f"{first.base_url}/v1/chat/completions/{path}/stream",
                             headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(("gateway", "headers"), [
    (0, {"X-Keep-On-Disconnect": "false"}),  # a client that says so: cancelled at once
    (1, {}),  # any other: cancelled once the gateway's grace period (1 s) has passed
], ids=["at-once", "after-the-grace"])
def test_a_client_that_disconnects_cancels_its_request(gateways, gateway: int,
                                                       headers: dict[str, str]) -> None:
    r = gateways[2]
    request_id = f"gone-1-{gateway}"
    body = {**BODY, "max_tokens": 150}
    # Given a long streaming request, read for a few events
    with httpx.stream("POST", f"{gateways[gateway].base_url}/v1/chat/completions", json=body,
                      headers={**AUTH, "X-Request-Id": request_id, **headers},
                      timeout=60) as response:
        read_events(response, limit=3)
    # When the client has gone, Then the worker stops it: a cancelled done, far short of 150
    key = Keys().result(f"alice:{request_id}")

    def final() -> Done | None:
        events = [decode_event(f) for _, f in r.xrange(key)]
        return events[-1] if events and isinstance(events[-1], Done) else None

    done = wait_for(final, 30, "the cancelled request's done event")
    assert done.finish_reason == "cancelled" and done.usage.completion_tokens < 150
    # And the worker has freed it
    wait_for(lambda: r.hget(Keys().worker("gw-streams-w1"), "running") == b"0", 15,
             "the worker to report nothing running")


def test_a_dropped_stream_resumed_within_the_grace_period_continues(gateways) -> None:
    first, second, r = gateways
    body = {**BODY, "max_tokens": 120}
    whole = text_of(uncut_body(first, "grace-whole-1", body))
    # Given a stream dropped after 5 events, with no header asking to keep it
    with httpx.stream("POST", f"{first.base_url}/v1/chat/completions", json=body,
                      headers={**AUTH, "X-Request-Id": "grace-1"}, timeout=60) as response:
        head = read_events(response, limit=5)
    last_id = [event_id for event_id, _ in head if event_id][-1]
    # When the client comes back 5 s later, on another gateway
    time.sleep(5)
    with httpx.stream("GET", f"{second.base_url}/v1/chat/completions/grace-1/stream",
                      headers={**AUTH, "Last-Event-ID": last_id}, timeout=60) as response:
        tail, done_at = [], 0.0
        for event in iter_events(response):
            tail.append(event)
            if event[1] == "[DONE]":
                done_at = time.monotonic()
        ended = time.monotonic()
    # Then the text continues to the same whole answer, the request never cancelled
    assert text_of(head) + text_of(tail) == whole and tail[-1][1] == "[DONE]"
    done = [decode_event(f) for _, f in r.xrange(Keys().result("alice:grace-1"))][-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    # And the resumed response ends with [DONE], not seconds after it
    assert ended - done_at < 0.5


def test_a_non_streaming_client_that_disconnects_cancels_too(gateways) -> None:
    first, _, r = gateways
    body = {**BODY, "max_tokens": 150, "stream": False}
    body.pop("stream_options")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{first.base_url}/v1/chat/completions", json=body,
                   headers={**AUTH, "X-Request-Id": "gone-2"}, timeout=0.5)
    key = Keys().result("alice:gone-2")
    done = wait_for(lambda: next((e for e in (decode_event(f) for _, f in r.xrange(key))
                                  if isinstance(e, Done)), None), 30, "a done event")
    assert done.finish_reason == "cancelled"


def test_cancel_stops_a_request_of_ones_own_tenant_only(gateways) -> None:
    first, _, r = gateways
    # Given a kept request of alice's, running
    with httpx.stream("POST", f"{first.base_url}/v1/chat/completions", json={**BODY,
                      "max_tokens": 150}, headers={**AUTH, "X-Request-Id": "stop-1",
                                                   "X-Keep-On-Disconnect": "1"},
                      timeout=60) as streaming:
        read_events(streaming, limit=2)
    # When bob tries to cancel it, Then he is told there is no such request
    bob = httpx.post(f"{first.base_url}/v1/chat/completions/stop-1/cancel",
                     headers={"Authorization": f"Bearer {KEYS['bob']}"})
    assert bob.status_code == 404
    # And when alice cancels it, it ends cancelled
    assert httpx.post(f"{first.base_url}/v1/chat/completions/stop-1/cancel",
                      headers=AUTH).status_code == 200
    key = Keys().result("alice:stop-1")
    done = wait_for(lambda: next((e for e in (decode_event(f) for _, f in r.xrange(key))
                                  if isinstance(e, Done)), None), 30, "a done event")
    assert done.finish_reason == "cancelled"


def test_a_gateway_stopping_lets_its_open_streams_finish(gateways, tmp_path: Path) -> None:
    _, _, r = gateways
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    stopping = GatewayProcess(url, tmp_path, name="gateway-stopping").start()
    try:
        with httpx.stream("POST", f"{stopping.base_url}/v1/chat/completions",
                          json={**BODY, "max_tokens": 60},
                          headers={**AUTH, "X-Request-Id": "drain-1"}, timeout=60) as response:
            events = iter_events(response)
            head = list(itertools.islice(events, 3))
            # When the gateway is sent SIGTERM mid-stream (a rolling update)
            stopping.proc.send_signal(signal.SIGTERM)
            tail = list(events)
        # Then the stream still runs to its end, and the request was not cancelled
        assert tail[-1][1] == "[DONE]"
        chunks = [json.loads(d) for _, d in head + tail if d != "[DONE]"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        # (uvicorn re-raises the SIGTERM it handled once it has shut down)
        assert stopping.wait_exit(30) in (0, -signal.SIGTERM)
    finally:
        stopping.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_past_the_request_timeout_is_cancelled(gateways, tmp_path: Path,
                                                         stream: bool) -> None:
    _, _, r = gateways
    url = f"redis://127.0.0.1:{r.connection_pool.connection_kwargs['port']}/0"
    impatient = GatewayProcess(url, tmp_path, name=f"gateway-timeout-{stream}",
                               extra=["--request-timeout", "1"]).start()
    request_id = f"timeout-{stream}"
    # NOTE: 150 tokens at 15 ms a step (the worker's slow_step) take over 2 s, and fit the tiny
    # model's 256-token context (more would be refused before it runs).
    body = {**BODY, "max_tokens": 150, "stream": stream}
    if not stream:
        body.pop("stream_options")
    try:
        # Given a gateway with a 1 s request timeout, and a request that takes far longer
        response = httpx.post(f"{impatient.base_url}/v1/chat/completions", json=body,
                              headers={**AUTH, "X-Request-Id": request_id}, timeout=60)
        # When the timeout passes, Then the client is told so
        if stream:
            events = parse_sse(response.text)
            assert json.loads(events[-2][1])["error"]["code"] == "timeout"
            assert events[-1][1] == "[DONE]"
        else:
            assert response.status_code == 504, response.text
        # And the worker stops generating: a cancelled done, short of 150 tokens
        key = Keys().result(f"alice:{request_id}")
        done = wait_for(lambda: next((e for e in (decode_event(f) for _, f in r.xrange(key))
                                      if isinstance(e, Done)), None), 30, "a done event")
        assert done.finish_reason == "cancelled" and done.usage.completion_tokens < 150
    finally:
        impatient.stop()
