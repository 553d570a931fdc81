"""Tenants beside a live worker: hijacked ids, foreign cancels, forged records, queue wipes."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import CollectorRegistry

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import GROUP
from llmq.broker.work_lanes import work_lane
from llmq.protocol.errors import BrokerError, RequestIdConflict
from llmq.worker.metrics import WorkerMetrics
from llmq.worker.unread_loss import UnreadLoss
from llmq.worker.worker_config import WorkerConfig
from llmq.worker.worker_context import WorkerContext
from tests.fixtures.acl_server import PASSWORDS, acl_url
from tests.integration.tenant_harness import CANCEL, LANES, OWN_LANE, SUB, Q, url
from tests.integration.tenant_harness import tenants as tenants  # a fixture
from tests.integration.worker_harness import (
    KEYS,
    InProcessWorker,
    dead_letters,
    read_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis


def test_tenants_run_their_own_and_cannot_hijack_block_or_read_each_other(
        acl_server, tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    bob_raw = redis.Redis.from_url(url(port, "bob"))
    with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="tenant-worker"), \
            Client(url(port, "acme")) as acme, Client(url(port, "bob")) as bob:
        # Given bob, before acme ever submits acme:2, XADDs an entry naming acme's id
        hijack = bob_raw.xadd(Q, {"json": '{"id": "acme:2", "prompt": "bob writes here"}'})
        hijack = hijack.decode()
        error = wait_terminal(admin, hijack)
        # Then the worker refused it without writing acme's stream: the error went to the
        # entry's own stream, and to the dead letters
        assert isinstance(error, protocol.Error) and error.code == "invalid_request", error
        assert "acme" in error.message and not admin.exists(KEYS.result("acme:2"))
        assert any(letter.entry_id == hijack for letter, _ in dead_letters(admin))
        # When acme submits and runs its own requests, acme:2 included (not blocked)
        first = acme.result(acme.submit("Hi", request_id="acme:1", max_tokens=4), timeout=30)
        second = acme.result(acme.submit("Hi", request_id="acme:2", max_tokens=4), timeout=30)
        assert (first.attempt, second.attempt) == (1, 1)
        # Then bob can read none of it, nor cancel it, nor take over its marker
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            list(bob.events("acme:1", timeout=5))
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            bob.cancel("acme:1")
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            bob.submit("Hi", request_id="acme:3", max_tokens=4)
        with pytest.raises(redis.exceptions.NoPermissionError):
            bob_raw.set(KEYS.idempotency("default", "acme:4"), "1-0")
        # And a late raw duplicate of acme:1 leaves acme's finished stream untouched
        late = bob_raw.xadd(Q, {"json": '{"id": "acme:1", "prompt": "again"}'}).decode()
        assert wait_terminal(admin, late).code == "duplicate_id"
        assert [type(e).__name__ for e in read_events(admin, "acme:1")] == [
            "Start", "Delta", "Delta", "Delta", "Delta", "Done"]
    bob_raw.close()
    admin.close()


def test_a_tenant_queues_on_its_own_lanes_and_cannot_queue_on_anothers(
        acl_server, tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    bob_raw = redis.Redis.from_url(url(port, "bob"))
    with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="lane-worker"), \
            Client(url(port, "acme")) as acme:
        # When acme submits a batch request and an interactive one
        batch = acme.submit("Hi", request_id="acme:b1", max_tokens=4, lane="batch")
        online = acme.submit("Hi", request_id="acme:i1", max_tokens=4)
        # Then each went to acme's own lane stream, and the worker (its ACL user) ran both
        assert admin.xlen(OWN_LANE["stream"]) == 1
        assert admin.xlen(KEYS.lane_stream("default", "interactive:acme")) == 1
        assert acme.result(batch, timeout=30).attempt == 1
        assert acme.result(online, timeout=30).attempt == 1
        # And bob can neither add to acme's lane nor queue through it
        with pytest.raises(redis.exceptions.NoPermissionError):
            bob_raw.xadd(OWN_LANE["stream"], {"json": '{"prompt": "bob in acme\'s lane"}'})
        with pytest.raises(redis.exceptions.NoPermissionError):
            bob_raw.fcall("llmq_submit_lane", 3, OWN_LANE["stream"], OWN_LANE["records"], LANES,
                          "json", '{"prompt": "x"}')
        assert admin.xlen(OWN_LANE["stream"]) == 1
    bob_raw.close()
    admin.close()


def test_submit_raises_when_the_marker_names_no_entry_of_this_request(tenants) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    with Client(url(port, "acme")) as acme:
        # Given entries delivered and acked long ago (a worker's read), and markers naming an
        # entry that is gone, garbage, or an entry from the future
        acme.submit("Hi", request_id="acme:old", max_tokens=2)
        old_entry = admin.get(KEYS.idempotency("default", "acme:old")).decode()
        # NOTE: a tenant's interactive requests wait on its own lane (broker/work_lanes.py)
        lane = KEYS.lane_stream("default", "interactive:acme")
        admin.xreadgroup(GROUP, "w", {lane: ">"})
        admin.xack(lane, GROUP, old_entry)
        admin.xdel(lane, old_entry)
        admin.set(KEYS.idempotency("default", "acme:junk"), "not-an-entry")
        admin.set(KEYS.idempotency("default", "acme:future"), "99999999999999-0")
        # ... and one naming an entry just past the group's last delivery that was never added
        # (the shared producer's old hijack: "queued", with nothing queued)
        seconds, micros = admin.time()
        ghost = f"{seconds * 1000 + micros // 1000 + 500}-99999"
        admin.set(KEYS.idempotency("default", "acme:ghost"), ghost)
        # When acme submits those ids again, Then it is told instead of left waiting
        for rid in ("acme:old", "acme:junk", "acme:future", "acme:ghost"):
            with pytest.raises(RequestIdConflict, match=rid):
                acme.submit("Hi", request_id=rid, max_tokens=2)
        # While a marked entry still queued, or one that has a result, is a plain duplicate
        queued = acme.submit("Hi", request_id="acme:queued", max_tokens=2)
        assert acme.submit("Hi", request_id=queued, max_tokens=2) == "acme:queued"
    admin.close()


def shared_producer(port: int) -> redis.Redis:
    return redis.Redis(port=port, username="producer", password=PASSWORDS["producer"],
                       decode_responses=True)


def test_a_cancel_entry_naming_another_tenants_request_does_not_stop_it(
        tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    acme_raw = redis.Redis.from_url(url(port, "acme"))
    with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="cancel-worker",
                         fault="slow_step:30"), \
            Client(url(port, "acme")) as acme, Client(url(port, "bob")) as bob:
        # Given bob's long request running
        bob.submit("Hi", request_id="bob:long", max_tokens=48, ignore_eos=True)
        wait_for(lambda: any(isinstance(e, protocol.Delta)
                             for e in read_events(admin, "bob:long")), 30, "bob's first token")
        # When acme cancels it: its client (the flag is refused) and a raw cancel entry
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            acme.cancel("bob:long")
        acme_raw.xadd(CANCEL, protocol.encode_cancel("bob:long"))
        # Then bob's request runs to its end, untouched
        done = bob.result("bob:long", timeout=60)
        assert done.finish_reason == "length" and done.usage.completion_tokens == 48
        # While bob's own cancel (flag, then entry) still stops bob's request
        bob.submit("Hi", request_id="bob:mine", max_tokens=48, ignore_eos=True)
        wait_for(lambda: any(isinstance(e, protocol.Delta)
                             for e in read_events(admin, "bob:mine")), 30, "a token")
        bob.cancel("bob:mine")
        assert bob.result("bob:mine", timeout=60).finish_reason == "cancelled"
    acme_raw.close()
    admin.close()


def test_the_shared_producer_cannot_hijack_answer_for_or_block_a_tenants_id(
        tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    producer = shared_producer(port)
    with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="shared-worker"), \
            Client(acl_url(port, "producer")) as shared, Client(url(port, "bob")) as bob:
        shared.submit("Hi", request_id="job-1", max_tokens=2)  # its own ids still work
        assert shared.result("job-1", timeout=30).attempt == 1
        # When the shared producer submits bob's id, or runs the function on bob's marker
        with pytest.raises(BrokerError, match="NOPERM|permission"):
            shared.submit("producer's prompt", request_id="bob:h2", max_tokens=4)
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.fcall("llmq_submit", 3, Q, SUB, KEYS.idempotency("default", "bob:h2"),
                           "json", '{"id": "bob:h2", "prompt": "x"}', "60", "bob:h2")
        # ... or pre-sets bob's marker, reads or cancels bob's requests
        for attempt in (lambda: producer.set(KEYS.idempotency("default", "bob:h4"), "1-0"),
                        lambda: producer.set(KEYS.cancel_flag("bob:h4"), "1"),
                        lambda: producer.xrange(KEYS.result("bob:h4"))):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        # ... or sets what used to be bob's marker's name (a key nobody reads now)
        seconds, _ = producer.time()
        producer.set("llmq:id:{default}:bob:h4", f"{seconds * 1000 + 500}-99999")
        # Then bob's own submits of those ids run bob's prompt, and bob's alone
        assert bob.result(bob.submit("Hi", request_id="bob:h2", max_tokens=3),
                          timeout=30).usage.completion_tokens == 3
        assert bob.result(bob.submit("Hi", request_id="bob:h4", max_tokens=3),
                          timeout=30).attempt == 1
        assert [type(e).__name__ for e in read_events(admin, "bob:h2")].count("Start") == 1
        # And a raw XADD naming bob's id runs nowhere near bob's stream
        raw = producer.xadd(Q, {"json": '{"id": "bob:h5", "prompt": "x", "max_tokens": 2}'})
        assert wait_terminal(admin, raw).code == "invalid_request"
        assert not admin.exists(KEYS.result("bob:h5"))
    producer.close()
    admin.close()


def test_a_forged_submission_record_cannot_fail_another_tenants_request(
        tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    acme_raw = redis.Redis.from_url(url(port, "acme"))
    # Given an entry a dead worker (no heartbeat) held, deleted from the stream while pending
    admin.xgroup_create(Q, GROUP, id="0", mkstream=True)
    lost = admin.xadd(Q, {"json": '{"prompt": "x"}'}).decode()
    admin.xreadgroup(GROUP, "dead-worker", {Q: ">"}, count=1)
    admin.xdel(Q, lost)
    with Client(url(port, "bob")) as bob:
        bob.submit("Hi", request_id="bob:run", max_tokens=40, ignore_eos=True)
        # And acme's forged record saying that entry was bob's running request
        acme_raw.hset(SUB, lost, "bob:run")
        with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="healthy",
                             fault="slow_step:100"):
            wait_for(lambda: any(isinstance(e, protocol.Delta)
                                 for e in read_events(admin, "bob:run")), 30, "bob runs")
            # When the worker takes the dead worker's entry and finds it gone
            error = wait_terminal(admin, lost)
            # Then the lost payload is answered on the entry's own stream, not bob's
            assert isinstance(error, protocol.Error) and error.code == "lost_payload"
            done = bob.result("bob:run", timeout=60)
    assert done.finish_reason == "length" and done.usage.completion_tokens == 40
    assert [type(e).__name__ for e in read_events(admin, "bob:run")].count("Error") == 0
    acme_raw.close()
    admin.close()


def test_forged_records_cannot_stall_the_lost_payload_pass_or_answer_a_finished_request(
        tenants, tiny_model) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    acme_raw = redis.Redis.from_url(url(port, "acme"))
    with Client(acl_url(port, "producer")) as shared, Client(url(port, "acme")) as acme:
        # Given a finished id-less request of the shared producer, trimmed from the queue
        with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="first"):
            finished = shared.submit("Hi", max_tokens=2)
            shared.result(finished, timeout=30)
            wait_for(lambda: not admin.hexists(SUB, finished), 10, "its record acked")
        admin.xdel(Q, finished)
        before = read_events(admin, finished)
        # And acme's request trimmed from its lane before any worker read it (a genuine record)
        acme.submit("Hi", request_id="acme:gone", max_tokens=2)
        gone = admin.get(KEYS.idempotency("default", "acme:gone")).decode()
        lane = work_lane(KEYS, "default", None, "acme")
        admin.xdel(lane.stream, gone)
        # When acme forges records: one naming no entry, one naming the finished request
        acme_raw.hset(SUB, mapping={"not-an-entry": "x", finished: finished})
        with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="second") as w:
            w.worker.reclaimer.answer_vanished_unread()
            w.worker.reclaimer.answer_vanished_unread(lane)
            # Then acme's lost request is answered, by name, in the same pass
            error = wait_terminal(admin, "acme:gone")
            assert isinstance(error, protocol.Error) and error.code == "lost_payload"
            wait_for(lambda: admin.hlen(SUB) == 0, 10, "every record cleared")
            wait_for(lambda: admin.hlen(lane.submissions) == 0, 10, "the lane's records too")
    # And the finished request's stream is as it was
    assert read_events(admin, finished) == before
    acme_raw.close()
    admin.close()


def test_a_queue_wipe_by_a_tenants_raw_xadd_is_reported_once(tenants) -> None:
    port = tenants
    worker = redis.Redis.from_url(acl_url(port, "worker"))
    acme_raw = redis.Redis.from_url(url(port, "acme"))
    metrics = WorkerMetrics("tiny", "default", registry=CollectorRegistry())
    ctx = WorkerContext(WorkerConfig(redis_url=acl_url(port, "worker"), worker_id="w1"), "tiny",
                        4, metrics)
    loss = UnreadLoss(ctx)
    # Given a queue where one request ran and two (bob's, say) wait
    worker.xgroup_create(Q, GROUP, id="0", mkstream=True)
    for _ in range(3):
        acme_raw.xadd(Q, {"json": '{"prompt": "x"}'})
    ((_, [(ran, _)]),) = worker.xreadgroup(GROUP, "w1", {Q: ">"}, count=1)
    worker.xack(Q, GROUP, ran)
    # Then waiting entries are not a loss
    assert loss.check(worker) == 0
    # When acme wipes the queue with a raw XADD ... MAXLEN 0 (an ACL cannot refuse it)
    acme_raw.xadd(Q, {"json": '{"prompt": "wipe"}'}, maxlen=0, approximate=False)
    assert worker.xlen(Q) == 0
    # Then the next look reports the three entries no worker read (the two and the wipe's own),
    # once, whichever worker looks
    assert loss.check(worker) == 3
    assert loss.check(worker) == 0 and UnreadLoss(ctx).check(worker) == 0
    # ... as a dead letter with no request id, a metric, and in the queue's stats
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    ((letter, payload),) = dead_letters(admin)
    assert letter.code == "lost_payload" and letter.request_id is None and not payload
    assert "3 request entries were trimmed" in letter.message
    assert metrics.registry.get_sample_value(
        "llmq_entries_lost_unread_total", {"model": "tiny", "queue": "default"}) == 3
    with Client(acl_url(port, "admin")) as client:
        assert client.stats().lost_unread == 3
    # And a later wipe adds to it
    acme_raw.xadd(Q, {"json": '{"prompt": "again"}'}, maxlen=0, approximate=False)
    assert loss.check(worker) == 1
    for client in (worker, acme_raw, admin):
        client.close()


def test_the_queue_registry_is_the_workers_and_its_readers_skip_bad_names(tenants) -> None:
    port = tenants
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    # Given tenants may not register queues (one bad name would break every reader's list;
    # 20,000 would make every cancel slow)
    acme_raw = redis.Redis.from_url(url(port, "acme"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme_raw.sadd(KEYS.queues(), "bad name")
    # ... and their client's group creation gets by without it
    with Client(url(port, "acme"), queue="fresh") as acme:
        acme.submit("Hi", request_id="acme:1", max_tokens=2)
    admin.sadd(KEYS.queues(), "default")
    # When names no llmq process would write are in the registry anyway (an older ACL, an admin)
    admin.sadd(KEYS.queues(), "bad name", "x{y}", "*", "a" * 200)
    # Then the readers list the valid ones only
    with Client(acl_url(port, "admin")) as client:
        assert client.queues() == ["default"]
    acme_raw.close()
    admin.close()
