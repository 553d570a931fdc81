"""The job store (broker/job_progress.py) on a real server: what `llmq run status` and `llmq run
list` read, and the dashboard can."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from llmq.broker import job_progress
from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.broker.job_progress import JobProgress, JobRecord, StageCounts

pytestmark = pytest.mark.redis


@pytest.fixture
def client(redis_server, redis_client: redis.Redis) -> Iterator[Client]:
    with Client(redis_server.url) as client:
        yield client


def test_a_save_replaces_the_jobs_record_and_lists_it_newest_first(client: Client) -> None:
    store = JobProgress(client.keys)
    # Given two jobs saved, the first one saved again later with more rows done
    send(client, store.save(JobRecord(id="run-a", name="a", state="running", rows_done=10,
                                      stages=[StageCounts(name="summary", done=10)])))
    send(client, store.save(JobRecord(id="run-b", name="b", state="queued")))
    send(client, store.save(JobRecord(id="run-a", name="a", state="completed", rows_done=20,
                                      rows_total=20,
                                      stages=[StageCounts(name="summary", done=20)])))
    # Then the job's record is the last one saved, stamped with the time of the save
    record = send(client, store.get("run-a"))
    assert record is not None
    assert (record.state, record.rows_done, record.rows_total) == ("completed", 20, 20)
    assert record.stages == [StageCounts(name="summary", done=20)]
    assert abs(record.updated - time.time()) < 60
    # And the list has each job once, the most recently updated first
    assert send(client, store.recent_ids()) == ["run-a", "run-b"]
    assert [r.id for r in send(client, store.many(["run-b", "run-a", "run-gone"]))] == [
        "run-b", "run-a"]
    # And an unknown job has no record
    assert send(client, store.get("run-gone")) is None


def test_records_expire_and_the_list_keeps_the_newest(client: Client,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = JobProgress(client.keys)
    monkeypatch.setattr(job_progress, "MAX_LISTED", 3)
    # Given five jobs saved one after the other, the last with a TTL of one second
    for n in range(4):
        send(client, store.save(JobRecord(id=f"run-{n}", name=str(n))))
    send(client, store.save(JobRecord(id="run-4", name="4"), ttl=1))
    # Then the list keeps the three newest
    assert send(client, store.recent_ids()) == ["run-4", "run-3", "run-2"]
    # And the short-lived record is gone after its TTL
    deadline = time.monotonic() + 30
    while send(client, store.get("run-4")) is not None:
        assert time.monotonic() < deadline, "the record never expired"
        time.sleep(0.2)
    assert [r.id for r in send(client, store.many(send(client, store.recent_ids())))] == [
        "run-3", "run-2"]


def test_a_running_record_nobody_updates_is_stale() -> None:
    record = JobRecord(id="run-x", name="x", state="running", updated=1000.0)
    assert not record.is_stale(now=1030.0)
    assert record.is_stale(now=1000.0 + job_progress.STALE_AFTER + 1)
    finished = JobRecord(id="run-y", name="y", state="completed", updated=1000.0)
    assert not finished.is_stale(now=1_000_000.0)
