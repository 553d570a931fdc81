"""The broker's stores (file store, batch records, dead-letter entries, pool samples, stream
options, request lookup) against real servers, sent by the sync and the asyncio client alike."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis

from llmq.broker import AsyncClient, Client
from llmq.broker.batch_records import BatchRecords
from llmq.broker.dead_letter_entries import DeadLetterEntries
from llmq.broker.exchange import send, send_async
from llmq.broker.file_store import FileStore
from llmq.broker.keys import Keys
from llmq.broker.pool_samples import PoolSample, PoolSamples
from llmq.broker.request_lookup import RequestLookup
from llmq.broker.stream_options import StreamOptions
from llmq.protocol import DeadLetter, encode_dead_letter

pytestmark = pytest.mark.redis

KEYS = Keys()


@pytest.fixture
def client(redis_server: Any, redis_client: redis.Redis) -> Any:
    with Client(redis_server.url) as c:
        yield c


def test_a_file_round_trips_under_its_tenant_only(redis_server: Any,
                                                  redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with AsyncClient(redis_server.url) as client:
            alice, bob = FileStore(KEYS, "alice"), FileStore(KEYS, "bob")
            meta = {"id": "file-1", "filename": "in.jsonl", "purpose": "batch", "bytes": 3}
            await send_async(client, alice.create("file-1", b"abc", meta, 60, 1000))
            # the owner finds it, its content and its place in the index
            found = await send_async(client, alice.meta("file-1"))
            assert found is not None and found["filename"] == "in.jsonl" and found["bytes"] == "3"
            assert await send_async(client, alice.content(found)) == b"abc"
            assert await send_async(client, alice.ids()) == ["file-1"]
            assert 0 < redis_client.ttl(KEYS.tenant_files("alice")) <= 60
            # another tenant does not
            assert await send_async(client, bob.meta("file-1")) is None
            # deleted, it is gone with its record and index entry
            await send_async(client, alice.delete("file-1"))
            assert await send_async(client, alice.metas(["file-1"])) == [None]
            assert await send_async(client, alice.ids()) == []

    asyncio.run(scenario())


def test_a_batch_file_record_reads_the_batch_lines(client: Client) -> None:
    records, files = BatchRecords(KEYS), FileStore(KEYS, "alice")
    send(client, records.write_results("batch_1", [b'{"a":1}', b'{"a":2}'], [b'{"e":1}'], 60))
    send(client, files.record("file-out", {"id": "file-out", "batch": "batch_1",
                                           "kind": "output"}, 60, 1000))
    meta = send(client, files.meta("file-out"))
    assert meta is not None
    assert send(client, files.content(meta)) == b'{"a":1}\n{"a":2}\n'
    assert send(client, records.results("batch_1")) == ([b'{"a":1}', b'{"a":2}'], [b'{"e":1}'])
    # a rewrite (an rq retry of the job) replaces the lines whole
    send(client, records.write_results("batch_1", [b'{"a":3}'], [], 60))
    assert send(client, records.results("batch_1")) == ([b'{"a":3}'], [])


def test_the_cancel_flag_and_the_input_of_a_batch(client: Client) -> None:
    records = BatchRecords(KEYS)
    assert send(client, records.cancel_requested("batch_1")) is False
    send(client, records.request_cancel("batch_1", 60))
    assert send(client, records.cancel_requested("batch_1")) is True
    send(client, records.store_input("batch_1", b"line\n", 60))
    assert send(client, records.input(KEYS.batch_input("batch_1"))) == b"line\n"
    assert send(client, records.input(KEYS.batch_input("batch_2"))) is None


def test_dead_letters_are_paged_and_deleted_one_by_one(client: Client,
                                                       redis_client: redis.Redis) -> None:
    # Given five dead letters and one entry that is none
    for n in range(5):
        letter = DeadLetter(queue="default", entry_id=f"{n + 1}-0", request_id=f"t:r{n}",
                            code="poison", message="test")
        redis_client.xadd(KEYS.dlq("default"), encode_dead_letter(letter, {
            "json": json.dumps({"id": f"t:r{n}", "prompt": "Hi"})}))
    redis_client.xadd(KEYS.dlq("default"), {"junk": "1"})
    entries = DeadLetterEntries(KEYS, "default")
    # Then the newest come newest first, the junk skipped
    newest = send(client, entries.newest(3))
    assert [e.dead_letter.request_id for e in newest] == ["t:r4", "t:r3"]
    # And pages walk them all in order
    seen, start = [], "-"
    while True:
        page = send(client, entries.page(start, 2))
        seen += [e.dead_letter.request_id for e in page.entries]
        if page.next_start is None:
            break
        start = page.next_start
    assert seen == [f"t:r{n}" for n in range(5)]
    # And one is found by its id, and chosen ones deleted
    one = send(client, entries.entry(newest[0].dlq_entry_id))
    assert one is not None and one.dead_letter.request_id == "t:r4"
    assert send(client, entries.delete([newest[0].dlq_entry_id, newest[1].dlq_entry_id])) == 2
    assert send(client, entries.entry(newest[0].dlq_entry_id)) is None


def test_one_pool_sample_lands_per_interval(client: Client) -> None:
    samples = PoolSamples(KEYS, maxlen=100)
    assert send(client, samples.offer(PoolSample(t=10_000, lag=1))) is True
    # another replica's sample for the same interval is refused, not an error
    assert send(client, samples.offer(PoolSample(t=10_000, lag=2))) is False
    assert send(client, samples.offer(PoolSample(t=20_000, lag=3))) is True
    assert [s.lag for s in send(client, samples.since(0))] == [1, 3]
    assert [s.lag for s in send(client, samples.since(10_001))] == [3]


def test_stream_options_and_what_is_known_of_a_request(client: Client) -> None:
    options = StreamOptions(KEYS)
    assert send(client, options.read("t:r1")) is None
    send(client, options.remember("t:r1", {"endpoint": "chat", "usage": 1}, 60))
    assert send(client, options.read("t:r1")) == {"endpoint": "chat", "usage": "1"}
    lookup = RequestLookup(KEYS)
    assert send(client, lookup.known("job-1", ["default"])) is False
    client.submit("Hi", request_id="job-1")
    assert send(client, lookup.known("job-1", ["other", "default"])) is True
    assert send(client, lookup.marked("default", "job-1")) is True
    entry_id = client.submit("Hi")
    in_queue = lookup.in_queue("default", entry_id)
    assert in_queue is not None and send(client, in_queue) is True
    assert lookup.in_queue("default", "job-1") is None  # only an entry id can be looked up
    transcript, events = send(client, lookup.events(entry_id))
    assert events == [] and transcript.final is None
