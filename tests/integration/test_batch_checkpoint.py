"""A batch job's checkpoint and deadline (gateway/batch_job.py) on a real server, no pool.

No worker serves the queue, so submitted requests only wait: what a run writes comes from its
checkpoint, its validation, or its deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis

from llmq.broker.batch_records import BatchRecords
from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.gateway.batch_job import BatchRun
from llmq.gateway.batch_store import BatchStore

pytestmark = pytest.mark.redis


def line(custom_id: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": custom_id, "max_tokens": 4}})


@pytest.fixture
def client(redis_server, redis_client: redis.Redis) -> Iterator[Client]:
    with Client(redis_server.url) as client:
        client.ensure_group()
        yield client


def start(client: Client, batch_id: str, lines: list[str], deadline: float) -> BatchRun:
    store = BatchStore(client.redis, client)
    send(client, BatchRecords(client.keys).store_input(batch_id, "\n".join(lines).encode(), 60))
    job = store.enqueue(batch_id, queue="default", max_in_flight=8, ttl=60, timeout=60,
                        description="test", meta={})
    return BatchRun(client, batch_id, job, max_in_flight=8, ttl=60, deadline=deadline)


def test_a_batch_past_its_deadline_expires_with_what_it_has(client: Client) -> None:
    # Given a batch whose first line a lost run had checkpointed, and whose deadline has passed
    # (its third line is JSON but no request: an error line of its own; a line that is not JSON
    # at all would fail the whole file before anything runs, as OpenAI's batches do)
    bad = json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": 5}})
    lines = [line("a"), line("b"), bad, line("c")]
    run = start(client, "batch_x1", lines, deadline=time.time() - 1)
    saved = {"id": "batch_x1.1", "custom_id": "a", "response": {"status_code": 200}}
    send(client, BatchRecords(client.keys).save_lines(
        "batch_x1", {0: b"o" + json.dumps(saved).encode()}, 60))
    # When it runs
    summary = run.run()
    # Then it ends expired: the checkpointed line kept, the bad line its error, the rest expired
    assert summary == {"status": "expired", "total": 4, "completed": 1, "failed": 3}
    outputs, errors = send(client, BatchRecords(client.keys).results("batch_x1"))
    assert [json.loads(o)["custom_id"] for o in outputs] == ["a"]
    codes = {json.loads(e)["custom_id"]: json.loads(e)["error"]["code"] for e in errors}
    assert codes == {None: "invalid_request", "b": "batch_expired", "c": "batch_expired"}
    # And its lease is released: no batch worker will take it for abandoned
    assert send(client, BatchRecords(client.keys).lease_holder("batch_x1")) is None


def test_a_rerun_keeps_every_checkpointed_line_once(client: Client) -> None:
    # Given a batch whose lines all finished in an earlier run, checkpointed in any order
    lines = [line(f"k{i}") for i in range(30)]
    records = {i: b"o" + json.dumps({"custom_id": f"k{i}", "response": {}}).encode()
               for i in reversed(range(30))}
    run = start(client, "batch_x2", lines, deadline=time.time() + 60)
    send(client, BatchRecords(client.keys).save_lines("batch_x2", records, 60))
    # When a second run of it runs (an rq retry, or another batch worker's)
    summary = run.run()
    # Then it submits nothing and writes each custom_id once, in input order
    assert summary["status"] == "completed" and summary["completed"] == 30
    outputs, errors = send(client, BatchRecords(client.keys).results("batch_x2"))
    assert [json.loads(o)["custom_id"] for o in outputs] == [f"k{i}" for i in range(30)]
    assert errors == [] and client.stats().length == 0
