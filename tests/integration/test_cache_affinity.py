"""Prefix-cache affinity: a request runs where its prefix is cached, and never waits for it long.

Two workers on the tiny random Llama and a real server. Worker `wa` computes a 160-token prefix
first, then is kept busy (one seat, slowed steps) so that `wb` is the one that reads the next
request with that prefix. With affinity, `wb` hands it to `wa` (worker/affinity_keeper.py):
the entry stays in the request stream, pending under `wa` now, and runs there once `wa` has
room; or, when `wa` stays busy past the steal delay, the idle `wb` takes it back. Either way it
runs once: one `start`, attempt 1, one terminal event. When `wa` dies holding such entries, `wb`
takes them and every request is answered exactly once. Entries of lane streams (the batch lane
of file jobs and the Batch API, a tenant's lanes) are handed over within their own stream and
acked there by whoever runs them.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import GROUP
from llmq.broker.work_lanes import BATCH, INTERACTIVE, WorkLane, work_lane
from llmq.cli.status import status
from tests.integration.worker_harness import (
    KEYS,
    InProcessWorker,
    WorkerProcess,
    num_pending,
    read_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis

PREFIX = [7 + (i * 13) % 90 for i in range(160)]  # ten 16-token blocks, shared
AFFINITY = {"affinity_min_tokens": 64}


def prompt(suffix: int, max_tokens: int = 4) -> dict[str, object]:
    return {"prompt_token_ids": [*PREFIX, 100 + suffix, 101, 102], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


BUSY = {"prompt_token_ids": [3, 4, 5, 6], "max_tokens": 150, "temperature": 0,
        "ignore_eos": True}
# The batch lane (`llmq submit -f`, the Batch API, dataset jobs) and tenant acme's lanes.
BATCH_LANE = work_lane(KEYS, "default", BATCH)
ACME_INTERACTIVE = work_lane(KEYS, "default", INTERACTIVE, "acme")
ACME_BATCH = work_lane(KEYS, "default", BATCH, "acme")


def submit(client: Client, request: dict[str, object]) -> str:
    (request_id,) = client.submit_many([request])
    return request_id


def settled(r: redis.Redis, lane: WorkLane) -> bool:
    """Nothing of `lane` is pending or unacked: every entry was acked on its own stream."""
    return r.xpending(lane.stream, GROUP)["pending"] == 0 and r.hlen(lane.submissions) == 0


def starts(r: redis.Redis, request_id: str) -> list[protocol.Start]:
    return [e for e in read_events(r, request_id) if isinstance(e, protocol.Start)]


def terminals(r: redis.Redis, request_id: str) -> list[protocol.Event]:
    return [e for e in read_events(r, request_id) if protocol.is_terminal(e)]


def assert_ran_once_on(r: redis.Redis, request_id: str, worker_id: str) -> None:
    """The request started once, on `worker_id`, as attempt 1, and has one terminal event."""
    assert [(s.worker, s.attempt) for s in starts(r, request_id)] == [(worker_id, 1)]
    assert len(terminals(r, request_id)) == 1


def hit_rates(url: str) -> tuple[float | None, dict[str, float | None]]:
    """`llmq status --json`'s pool-wide and per-worker prefix-cache hit rates."""
    shown = CliRunner().invoke(status, ["--redis-url", url, "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    (queue,) = [q for q in report["queues"] if q["queue"] == "default"]
    return queue["prefix_hit_rate"], {w["worker_id"]: w["prefix_hit_rate_total"]
                                      for w in report["workers"]}


def holder_busy(url: str, r: redis.Redis, tiny_model, client: Client,
                **config: object) -> tuple[InProcessWorker, str]:
    """`wa` running, with the prefix in its cache and one long request filling its one seat."""
    wa = InProcessWorker(url, tiny_model, worker_id="wa", max_num_seqs=1,
                         fault="slow_step:40", **AFFINITY, **config).__enter__()
    warm = submit(client, prompt(0))
    assert isinstance(wait_terminal(r, warm), protocol.Done)
    busy = submit(client, BUSY)
    wait_for(lambda: starts(r, busy), 30, "the busy request to start on wa")
    return wa, busy


def reader_seeing(url: str, tiny_model, **config: object) -> InProcessWorker:
    """`wb` running, once its router knows what `wa`'s cache holds."""
    wb = InProcessWorker(url, tiny_model, worker_id="wb", **AFFINITY, **config).__enter__()
    assert wb.worker.affinity is not None
    router = wb.worker.affinity.router
    wait_for(lambda: any(p.worker_id == "wa" and p.landmarks for p in router.peers()), 30,
             "wb to see wa's prefix summary")
    return wb


def test_a_request_read_by_one_worker_runs_where_its_prefix_is_cached(
        redis_server, redis_client, tiny_model) -> None:
    with Client(redis_server.url) as client:
        # Given wa holds the prefix and is busy, and wb (idle, prefix not cached) reads next
        wa, busy = holder_busy(redis_server.url, redis_client, tiny_model, client,
                               affinity_steal_delay=120)
        wb = reader_seeing(redis_server.url, tiny_model, affinity_steal_delay=120)
        try:
            # When a request with that prefix arrives
            request_id = submit(client, prompt(1))
            final = wait_terminal(redis_client, request_id, timeout=60)
            # Then wb handed it over, and it ran once, on wa, as attempt 1, after the busy one
            assert isinstance(final, protocol.Done)
            assert_ran_once_on(redis_client, request_id, "wa")
            assert wb.worker.affinity is not None and wb.worker.affinity.num_handed == 1
            assert terminals(redis_client, busy)
            # And the prefix was served from wa's cache
            assert final.usage.cached_prompt_tokens >= len(PREFIX)
            # And `llmq status` shows the hit rates: wa's (once it has beaten), which is the
            # pool's, wb having run nothing
            wait_for(lambda: hit_rates(redis_server.url)[1].get("wa"), 30, "wa's hit rate")
            pool, per_worker = hit_rates(redis_server.url)
            assert pool is not None and 0 < pool < 1
            assert per_worker == {"wa": pool, "wb": None}
        finally:
            wb.stop()
            wa.stop()


def test_lane_entries_are_handed_over_within_their_own_streams(
        redis_server, redis_client, tiny_model) -> None:
    with Client(redis_server.url) as client:
        # Given wa holds the prefix and is busy, and wb (idle, prefix not cached) reads next
        wa, busy = holder_busy(redis_server.url, redis_client, tiny_model, client,
                               affinity_steal_delay=120)
        wb = reader_seeing(redis_server.url, tiny_model, affinity_steal_delay=120)
        try:
            # When a batch request (as a file job queues it) and tenant acme's request with
            # that prefix arrive, each on its lane stream
            batch = submit(client, {**prompt(3), "lane": "batch"})
            tenant = submit(client, {**prompt(4), "id": "acme:aff-4"})
            finals = [wait_terminal(redis_client, rid, timeout=90) for rid in (batch, tenant)]
            # Then wb handed both over, and each ran once, on wa, as attempt 1, from its cache
            assert wb.worker.affinity is not None and wb.worker.affinity.num_handed == 2
            for request_id, final in zip((batch, tenant), finals, strict=True):
                assert isinstance(final, protocol.Done), final
                assert_ran_once_on(redis_client, request_id, "wa")
                assert final.usage.cached_prompt_tokens >= len(PREFIX)
            # And wa acked each on its own lane stream: nothing pending or unanswered there
            for lane in (BATCH_LANE, ACME_INTERACTIVE):
                wait_for(lambda lane=lane: settled(redis_client, lane), 30,
                         f"{lane.label} to settle")
            assert redis_client.xlen(KEYS.affinity_tickets("default", "wa")) == 0
            assert redis_client.xlen(KEYS.dlq("default")) == 0
        finally:
            wb.stop()
            wa.stop()
        assert terminals(redis_client, busy)


def test_an_idle_worker_takes_a_handed_request_after_the_steal_delay(
        redis_server, redis_client, tiny_model) -> None:
    with Client(redis_server.url) as client:
        # Given wa holds the prefix and stays busy, and wb steals after 1 s
        wa, busy = holder_busy(redis_server.url, redis_client, tiny_model, client)
        wb = reader_seeing(redis_server.url, tiny_model, affinity_steal_delay=1.0)
        try:
            # When a request with that prefix arrives and wb hands it to wa
            submitted_ms = int(redis_client.time()[0]) * 1000
            request_id = submit(client, prompt(2))
            final = wait_terminal(redis_client, request_id, timeout=60)
            # Then wb took it back once it had waited: it ran once, on wb, as attempt 1, while
            # wa was still on its long request
            assert isinstance(final, protocol.Done)
            assert_ran_once_on(redis_client, request_id, "wb")
            assert wb.worker.affinity is not None
            assert wb.worker.affinity.num_handed == 1 and wb.worker.affinity.num_stolen == 1
            start_ms = int(redis_client.xrange(KEYS.result(request_id))[0][0].decode()
                           .partition("-")[0])
            assert start_ms - submitted_ms >= 1000
        finally:
            wb.stop()
            wa.stop()
        assert terminals(redis_client, busy)


def test_an_idle_worker_takes_a_handed_lane_request_after_the_steal_delay(
        redis_server, redis_client, tiny_model) -> None:
    with Client(redis_server.url) as client:
        # Given wa holds the prefix and stays busy, and wb steals after 1 s
        wa, busy = holder_busy(redis_server.url, redis_client, tiny_model, client)
        wb = reader_seeing(redis_server.url, tiny_model, affinity_steal_delay=1.0)
        try:
            # When tenant acme's batch request with that prefix arrives and wb hands it to wa
            request_id = submit(client, {**prompt(5), "id": "acme:aff-5", "lane": "batch"})
            final = wait_terminal(redis_client, request_id, timeout=60)
            # Then wb took it back from wa's tickets: it ran once, on wb, as attempt 1, while wa
            # was still on its long request
            assert isinstance(final, protocol.Done)
            assert_ran_once_on(redis_client, request_id, "wb")
            assert wb.worker.affinity is not None
            assert wb.worker.affinity.num_handed == 1 and wb.worker.affinity.num_stolen == 1
            # And wb acked it on acme's batch lane
            wait_for(lambda: settled(redis_client, ACME_BATCH), 30, "acme's batch lane to settle")
        finally:
            wb.stop()
            wa.stop()
        assert terminals(redis_client, busy)


@pytest.mark.slow
def test_entries_handed_to_a_worker_that_dies_are_run_once_by_its_peer(
        redis_server, redis_client, tiny_model, tiny_model_path: Path, tmp_path: Path) -> None:
    # Given wa (a process, to be killed) holds the prefix and is busy with its one seat
    wa = WorkerProcess(redis_server.url, tiny_model_path, tmp_path, "wa", fault="slow_step:60",
                       max_num_seqs=1, extra=["--affinity-min-tokens", "64"]).start()
    wb: InProcessWorker | None = None
    try:
        wa.wait_ready(redis_client)
        with Client(redis_server.url) as client:
            assert isinstance(wait_terminal(redis_client, submit(client, prompt(0))),
                              protocol.Done)
            busy = submit(client, {**BUSY, "max_tokens": 120})
            wait_for(lambda: starts(redis_client, busy), 30, "the busy request on wa")
            wb = reader_seeing(redis_server.url, tiny_model, affinity_steal_delay=120)
            # And five requests with the prefix, two on the queue's stream, two on the batch
            # lane, one on tenant acme's batch lane, which wb reads and hands to wa
            tickets = KEYS.affinity_tickets("default", "wa")
            lanes: list[dict[str, object]] = [{}, {"lane": "batch"}, {},
                                              {"lane": "batch", "id": "acme:dead-3"},
                                              {"lane": "batch"}]
            ids = [submit(client, {**prompt(10 + i), **lane}) for i, lane in enumerate(lanes)]
            wait_for(lambda: redis_client.xlen(tickets) == 5, 30, "five tickets for wa")
        # When wa is killed with them waiting (and the busy one running)
        wa.signal(signal.SIGKILL)
        wa.wait(10)
        # Then wb runs each once: one start, on wb, one terminal event. (Attempt 1 when wb
        # took it from wa's tickets, 2 when its reclaimer took it from the dead wa first, as
        # any entry a dead worker held: both are a single run.)
        for request_id in ids:
            assert isinstance(wait_terminal(redis_client, request_id, timeout=60), protocol.Done)
            (start,) = starts(redis_client, request_id)
            assert start.worker == "wb" and start.attempt in (1, 2), (request_id, start)
            assert len(terminals(redis_client, request_id)) == 1
        # And the busy one is taken from the dead worker as its next attempt
        assert wait_terminal(redis_client, busy, timeout=90).attempt == 2
        # And nothing is left pending, ticketed or dead-lettered
        wait_for(lambda: num_pending(redis_client) == 0, 30, "no pending entries")
        for lane in (BATCH_LANE, ACME_BATCH):
            wait_for(lambda lane=lane: settled(redis_client, lane), 30,
                     f"{lane.label} to settle")
        # (wa's tickets now name entries wb's reclaimer took: wb's keeper drops them the next
        # time it is idle and looks at a gone peer's tickets, a quarter second at most)
        wait_for(lambda: redis_client.xlen(tickets) == 0, 10, "wa's stale tickets dropped")
        assert redis_client.xlen(KEYS.dlq("default")) == 0
    finally:
        if wb is not None:
            wb.stop()
        wa.stop()
