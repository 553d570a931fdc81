"""The worker runs as deploy/acl.conf's least-privilege `worker` user, producers as `producer`.

Every command a live worker sends (reads, the lease and ack functions, reclaim, result writes,
dead letters, heartbeats, cancel follow-up, the stop path) must be within the `worker` user's
permissions, or the worker would fail only in production. The function library is the admin's
to load (`llmq admin load-functions`): a worker that finds it missing or older says so and
waits. The server is the one test_acl.py starts: deploy/redis.conf + deploy/acl.conf, on both
server kinds.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis
from click.testing import CliRunner

from llmq import protocol
from llmq.broker import Client
from llmq.broker.functions import (
    LIBRARY,
    LIBRARY_VERSION,
    FunctionLibraryMissing,
    ensure_functions,
    library_versions,
)
from llmq.broker.keys import GROUP
from llmq.cli.main import cli
from tests.fixtures.acl_server import PASSWORDS, acl_url
from tests.integration.worker_harness import (
    KEYS,
    QUEUE_KEY,
    InProcessWorker,
    read_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis


def test_worker_serves_reclaims_cancels_and_stops_as_the_worker_user(acl_server, tiny_model
                                                                     ) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    admin.function_flush()
    try:
        # Given the function library, loaded by the admin (as at deploy)
        assert [s.loaded for s in ensure_functions(admin)] == [True]
        with Client(acl_url(port, "producer")) as producer:
            # Given an entry a dead consumer left pending, and a producer queueing more
            stale = producer.submit("Hi", request_id="left-behind", max_tokens=3)
            admin.xreadgroup(GROUP, "dead-worker", {QUEUE_KEY: ">"}, count=1)
            bad = admin.xadd(QUEUE_KEY, {"json": b'{"prompt": '}).decode()
            with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="acl-worker",
                                 fault="slow_step:20"):
                # When the worker serves as the `worker` user
                done = producer.result(producer.submit("Hi", max_tokens=4), timeout=30)
                reclaimed = producer.result(stale, timeout=30)
                long_id = producer.submit("Hi", max_tokens=400, ignore_eos=True)
                wait_for(lambda: len(admin.xrange(KEYS.result(long_id))) > 3, 30, "deltas")
                producer.cancel(long_id)
                cancelled = producer.result(long_id, timeout=30)
                wait_for(lambda: admin.xlen(KEYS.dlq("default")), 10, "a dead letter")
                assert admin.exists(KEYS.worker("acl-worker"))
        # Then generation, reclaim, cancel, dead letters and heartbeats all worked ...
        assert done.finish_reason == "length" and reclaimed.attempt == 2
        assert cancelled.finish_reason == "cancelled"
        assert protocol.decode_dead_letter(admin.xrange(KEYS.dlq("default"))[0][1])[0].entry_id \
            == bad
        # ... nothing is left pending, and the clean stop removed the heartbeat
        assert admin.xpending(QUEUE_KEY, GROUP)["pending"] == 0
        assert not admin.exists(KEYS.worker("acl-worker"))
        assert isinstance(wait_terminal(admin, stale), protocol.Done)
    finally:
        admin.flushall()
        admin.close()


def test_the_worker_user_may_hand_entries_over_and_take_them(acl_server) -> None:
    """Cache affinity's commands (broker/affinity_handover.py, worker/affinity_keeper.py) as
    the `worker` user: a summary, hand-overs on the queue's stream and on a tenant's lane
    stream, the owner's renewal, a peer's take."""
    from llmq.broker import replies
    from llmq.broker.affinity_handover import AffinityHandover
    from llmq.broker.work_lanes import BATCH, work_lane

    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    ensure_functions(admin)  # as at deploy: the hand-over's functions are in the library
    lane = work_lane(KEYS, "default", BATCH, "acme")
    with redis.Redis.from_url(acl_url(port, "worker")) as worker, \
            Client(acl_url(port, "admin")) as submitter:
        worker.xgroup_create(QUEUE_KEY, GROUP, "0", mkstream=True)
        entry_id = admin.xadd(QUEUE_KEY, {"json": b'{"prompt": "Hi"}'}).decode()
        (lane_request,) = submitter.submit_many([{"prompt": "Hi", "id": "acme:1",
                                                 "lane": "batch"}])
        worker.xreadgroup(GROUP, "wb", {QUEUE_KEY: ">", lane.stream: ">"}, count=1)
        (lane_entry,) = [e.decode() for e in admin.hkeys(lane.submissions)]
        # Given wa's summary, published the way its keeper does
        pipe = worker.pipeline(transaction=False)
        pipe.set(KEYS.affinity_summary("default", "wa"), b"\x01" * 8, px=5000)
        pipe.pexpire(KEYS.affinity_summary("default", "wa"), 5000)
        pipe.zadd(KEYS.affinity_members("default"), {"wa": 1})
        pipe.zrange(KEYS.affinity_members("default"), 0, -1)
        pipe.get(KEYS.affinity_summary("default", "wa"))
        pipe.xlen(KEYS.affinity_tickets("default", "wa"))
        pipe.execute()
        handover = AffinityHandover(KEYS, "default")
        # When wb hands both entries to wa, wa renews them, and wb takes them back
        assert handover.hand_over(worker, "wb", "wa", "01" * 8, [entry_id], 16) == ([entry_id],
                                                                                   [])
        assert handover.hand_over(worker, "wb", "wa", "01" * 8, [lane_entry], 16,
                                  lane) == ([lane_entry], [])
        assert handover.renew(worker, "wa") == 2
        worker.xread({KEYS.affinity_tickets("default", "wa"): "0-0"}, count=1, block=10)
        tickets = handover.tickets(worker, "wa", 8)
        assert [t.lane for t in tickets] == ["", "batch:acme"]
        # And a worker of the previous release (library version 4's calls name the queue's
        # stream for every ticket) neither takes nor drops the lane's ticket
        assert worker.fcall("llmq_aff_take", 3, QUEUE_KEY, KEYS.affinity_tickets("default", "wa"),
                            KEYS.handbacks("default"), GROUP, "wa", "wb",
                            tickets[1].ticket_id) == []
        assert worker.fcall("llmq_aff_renew", 2, QUEUE_KEY,
                            KEYS.affinity_tickets("default", "wa"), GROUP, "wa") == 1
        assert [t.ticket_id for t in handover.tickets(worker, "wa", 8)] == \
            [t.ticket_id for t in tickets]
        taken = handover.take(worker, "wa", "wb", tickets)
        # Then every command was the worker user's to send, and each entry is wb's again, on
        # its own stream
        assert [(t.entry.entry_id, t.attempt, t.lane) for t in taken] == [
            (entry_id, 1, handover.queue_lane), (lane_entry, 1, lane)]
        assert [(c.name, c.pending) for c in replies.consumers(
            worker.xinfo_consumers(lane.stream, GROUP)) if c.pending] == [("wb", 1)]
        assert lane_request == "acme:1"
        worker.delete(KEYS.affinity_summary("default", "wa"))
        assert handover.forget(worker, "wa")


def _older_library(version: int) -> str:
    return LIBRARY.replace(f"local VERSION = {LIBRARY_VERSION}", f"local VERSION = {version}")


def test_the_worker_user_cannot_load_the_library_and_is_told_what_to_run(acl_server) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.function_flush()
    try:
        with redis.Redis.from_url(acl_url(port, "worker")) as worker_user:
            # Given no library: the worker user sees it missing, and may not load it
            assert [s.found for s in library_versions(worker_user)] == [0]
            with pytest.raises(FunctionLibraryMissing, match="is missing: run `llmq admin "
                               "load-functions` as the admin user"):
                ensure_functions(worker_user)
            # Given an older one: reported with both versions, not used as if it were current
            admin.function_load(_older_library(LIBRARY_VERSION - 1))
            with pytest.raises(FunctionLibraryMissing,
                               match=f"version {LIBRARY_VERSION - 1}, older than the version "
                                     f"{LIBRARY_VERSION} this llmq needs"):
                ensure_functions(worker_user)
        # And `llmq admin load-functions` refuses the worker's URL, naming the admin user ...
        runner = CliRunner()
        refused = runner.invoke(cli, ["admin", "load-functions", "--check",
                                      "--redis-url", acl_url(port, "worker")])
        assert refused.exit_code == 1 and "older than the version" in refused.output
        refused = runner.invoke(cli, ["admin", "load-functions",
                                      "--redis-url", acl_url(port, "worker")])
        assert refused.exit_code == 1 and "connect as the admin user" in refused.output
        # ... and, run as the admin, replaces the older library
        loaded = runner.invoke(cli, ["admin", "load-functions",
                                     "--redis-url", acl_url(port, "admin")])
        assert loaded.exit_code == 0, loaded.output
        assert f"version {LIBRARY_VERSION} (was version {LIBRARY_VERSION - 1})" in loaded.output
        assert [s.found for s in library_versions(admin)] == [LIBRARY_VERSION]
    finally:
        admin.function_flush()
        admin.close()


def test_a_worker_on_an_older_library_takes_no_work_until_the_admin_loads_it(
        acl_server, tiny_model, caplog) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    admin.function_flush()
    # Given the previous release's library, whose submit producers still call
    admin.function_load(_older_library(LIBRARY_VERSION - 1))
    try:
        with Client(acl_url(port, "producer")) as producer:
            request_id = producer.submit("Hi", max_tokens=3)
            with caplog.at_level(logging.INFO, logger="llmq"), \
                    InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="acl-wait"):
                # When a worker starts as the worker user
                def complaints() -> list[str]:
                    return [r.getMessage() for r in caplog.records
                            if "llmq admin load-functions" in r.getMessage()]

                wait_for(complaints, 60, "the worker to report the library")
                # Then it says what is wrong and what to run, in one line
                (line,) = complaints()
                assert f"version {LIBRARY_VERSION - 1}, older than the version " \
                       f"{LIBRARY_VERSION}" in line and "\n" not in line
                # And it takes no work meanwhile (several of its checks later)
                time.sleep(2.0)
                assert admin.xinfo_groups(QUEUE_KEY)[0]["pending"] == 0
                # When the admin loads the library
                assert [s.loaded for s in ensure_functions(admin)] == [True]
                # Then the worker takes the request and answers it
                assert producer.result(request_id, timeout=60).finish_reason == "length"
                assert len(complaints()) == 1  # said once, not at every check
    finally:
        admin.flushall()
        admin.close()


def test_a_library_lost_mid_run_holds_the_acks_until_the_admin_loads_it_again(
        acl_server, tiny_model, caplog) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    ensure_functions(admin)
    try:
        with Client(acl_url(port, "producer")) as producer, \
                caplog.at_level(logging.INFO, logger="llmq"), \
                InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="acl-lost",
                                fault="slow_step:50"):
            # Given a request running on a worker of the worker user
            request_id = producer.submit("Hi", max_tokens=30, ignore_eos=True)
            wait_for(lambda: len(admin.xrange(KEYS.result(request_id))) >= 3, 60, "deltas")
            # When the library is lost while it runs (FUNCTION FLUSH; a restart without
            # persistence would do the same)
            admin.function_flush()
            # Then the answer is written, but the entry stays pending: the ack waits for the
            # library, and the worker says what to run
            assert wait_terminal(admin, request_id, timeout=60).finish_reason == "length"
            wait_for(lambda: any("llmq admin load-functions" in r.getMessage()
                                 for r in caplog.records), 30, "the worker to report it")
            assert admin.xpending(QUEUE_KEY, GROUP)["pending"] == 1
            # When the admin loads it again
            ensure_functions(admin)
            # Then the entry is acked, and no event was written twice
            wait_for(lambda: admin.xpending(QUEUE_KEY, GROUP)["pending"] == 0, 60, "the ack")
            events = read_events(admin, request_id)
            keys = [(type(e).__name__, e.attempt, getattr(e, "seq", None)) for e in events]
            assert len(keys) == len(set(keys)), keys
            assert len([e for e in events if protocol.is_terminal(e)]) == 1
    finally:
        admin.flushall()
        admin.close()
