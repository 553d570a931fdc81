"""Faults the worker pool must survive (docs/reliability.md), with `llmq worker` processes.

Workers are child processes on the tiny random Llama with short leases (1.5 s, renewed every
0.3 s, max_deliveries 3) and, where a test must act mid-generation, the TEST-ONLY fault hook
`slow_step:<ms>`. The invariants checked are docs/reliability.md's:
I1 every request ends with exactly one
terminal event per attempt that has one, I2 the client's view (highest attempt) is whole, I3 the
pending list drains, I5 bad requests do not take the worker down.
"""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.embedded import free_port
from llmq.broker.keys import GROUP
from tests.integration.worker_harness import (
    KEYS,
    MAX_DELIVERIES,
    QUEUE_KEY,
    WorkerProcess,
    dead_letters,
    num_pending,
    read_events,
    terminal_events,
    wait_for,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def workers(redis_server, tiny_model_path: Path, tmp_path: Path):
    """Factory of worker processes, all stopped (TERM, then KILL) at the end of the test."""
    started: list[WorkerProcess] = []

    def make(worker_id: str, **kwargs) -> WorkerProcess:
        w = WorkerProcess(redis_server.url, tiny_model_path, tmp_path, worker_id, **kwargs)
        started.append(w)
        return w.start()

    yield make
    for w in started:
        w.stop()


def assert_one_terminal_per_attempt(r: redis.Redis, request_id: str) -> protocol.Event:
    """I1 + I2: at most one terminal per attempt, and the highest attempt's is a whole answer."""
    events = read_events(r, request_id)
    terminals = terminal_events(events)
    attempts = [t.attempt for t in terminals]
    assert len(attempts) == len(set(attempts)), f"{request_id}: terminals {terminals}"
    final = max(terminals, key=lambda t: t.attempt)
    if isinstance(final, protocol.Done):
        deltas = [e for e in events if isinstance(e, protocol.Delta)
                  and e.attempt == final.attempt]
        assert [d.seq for d in deltas] == list(range(len(deltas))), request_id
        assert "".join(d.text for d in deltas) == final.text, request_id
    return final


def submit_all(url: str, n: int, **params) -> list[str]:
    with Client(url) as client:
        return client.submit_many([{"prompt_token_ids": [7 + i % 40, 3, 5], "temperature": 0,
                                    "ignore_eos": True, **params} for i in range(n)])


def started_by(r: redis.Redis, request_id: str) -> list[tuple[int, str]]:
    return [(e.attempt, e.worker) for e in read_events(r, request_id)
            if isinstance(e, protocol.Start)]


def test_sigkill_mid_generation_loses_nothing(redis_server, redis_client, workers) -> None:
    # Given two workers sharing 50 slow generations
    a = workers("victim", fault="slow_step:20", max_num_seqs=16).wait_ready(redis_client)
    b = workers("survivor", fault="slow_step:20", max_num_seqs=16).wait_ready(redis_client)
    ids = submit_all(redis_server.url, 50, max_tokens=24)
    # When one is SIGKILLed after it streamed a token
    def victim_streamed() -> bool:
        for rid in ids:
            events = read_events(redis_client, rid)
            if any(isinstance(e, protocol.Start) and e.worker == "victim" for e in events) and \
                    any(isinstance(e, protocol.Delta) for e in events):
                return True
        return False
    wait_for(victim_streamed, 60, "the victim's first delta")
    a.kill()
    # Then every request ends with one done for its final attempt ...
    finals = {rid: wait_terminal(redis_client, rid, timeout=120) for rid in ids}
    for rid in ids:
        final = assert_one_terminal_per_attempt(redis_client, rid)
        assert isinstance(final, protocol.Done) and final.finish_reason == "length", final
        assert final.usage.completion_tokens == 24
    # ... the victim's requests were rerun by the survivor as attempt 2 ...
    rerun = [rid for rid in ids if finals[rid].attempt == 2]
    assert rerun, "the victim held no request when it died"
    assert all(started_by(redis_client, rid)[-1] == (2, "survivor") for rid in rerun)
    # ... and the pending list drains to zero
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")
    assert b.alive()


def test_sigterm_under_load_drains_then_hands_back(redis_server, redis_client, workers) -> None:
    # Given a worker with a 1 s drain budget, busy with generations that need ~10 s
    lease = 10.0  # long, so a prompt takeover can only come from the hand-back
    a = workers("leaving", fault="slow_step:40", drain=1.0, lease=lease, renew=1.0)
    a.wait_ready(redis_client)
    long_ids = submit_all(redis_server.url, 6, max_tokens=200)
    short_ids = submit_all(redis_server.url, 4, max_tokens=2)
    wait_for(lambda: all(started_by(redis_client, rid) for rid in long_ids), 30,
             "the leaving worker to start everything")
    workers("staying", fault="slow_step:5", lease=lease, renew=1.0).wait_ready(redis_client)
    # When it gets SIGTERM
    signalled = time.monotonic()
    a.signal(signal.SIGTERM)
    wait_for(lambda: "stopping: no new reads" in a.log_tail(), 10, "the signal to land")
    late_ids = submit_all(redis_server.url, 3, max_tokens=2)
    # Then it exits 0 within the drain budget (plus start-up of the shutdown) ...
    assert a.wait(15) == 0, a.log_tail()
    assert time.monotonic() - signalled < 1.0 + 5.0, a.log_tail()
    # ... what it did not finish is handed back at once, not left to the 10 s lease ...
    for p in redis_client.xpending_range(QUEUE_KEY, GROUP, min="-", max="+", count=100):
        assert p["consumer"] == b"staying" or p["time_since_delivered"] > lease * 1000, p
    # ... and everything completes: the unfinished ones on the other worker as attempt 2,
    # without a terminal event from the worker that left
    for rid in long_ids + short_ids + late_ids:
        wait_terminal(redis_client, rid, timeout=120)
        final = assert_one_terminal_per_attempt(redis_client, rid)
        assert isinstance(final, protocol.Done), final
    for rid in long_ids:
        assert started_by(redis_client, rid) == [(1, "leaving"), (2, "staying")]
        assert [t.attempt for t in terminal_events(read_events(redis_client, rid))] == [2]
    # ... and nothing queued after the signal went to the leaving worker
    for rid in late_ids:
        assert started_by(redis_client, rid) == [(1, "staying")]
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")


def test_hand_backs_by_draining_workers_do_not_make_a_request_poison(
        redis_server, redis_client, workers) -> None:
    # Given a long generation, and workers that are each scaled down while running it, more
    # times than max_deliveries allows failures
    (rid,) = submit_all(redis_server.url, 1, max_tokens=200)
    drains = MAX_DELIVERIES + 1
    for n in range(1, drains + 1):
        w = workers(f"scaled-down-{n}", fault="slow_step:40", drain=0.2).wait_ready(redis_client)
        wait_for(lambda n=n: (n, f"scaled-down-{n}") in started_by(redis_client, rid), 30,
                 f"attempt {n} to start")
        w.signal(signal.SIGTERM)
        assert w.wait(15) == 0, w.log_tail()
    # When a worker that stays takes it over
    workers("stays").wait_ready(redis_client)
    # Then it runs to the end as the next attempt: hand-backs were not counted as failures
    final = wait_terminal(redis_client, rid, timeout=60)
    assert isinstance(final, protocol.Done) and final.attempt == drains + 1, final
    assert dead_letters(redis_client) == []
    # And its hand-back count is gone with the ack
    assert not redis_client.hexists(KEYS.handbacks("default"), rid)


def test_poison_request_is_dead_lettered_after_max_deliveries(redis_server, redis_client,
                                                              workers) -> None:
    # Given a request that crashes the engine every time it runs (TEST-ONLY fault hook)
    with Client(redis_server.url) as client:
        client.submit("this one is POISON", request_id="poison-1", max_tokens=8)
    # When a restarted-on-exit worker keeps taking it (as Kubernetes restarts a pod)
    exits = []
    for attempt in range(1, 5):
        w = workers(f"restarting-{attempt}", fault="raise_in_step:POISON")
        wait_for(lambda w=w: dead_letters(redis_client) or not w.alive(), 30,
                 "a crash or a dead letter")
        if w.alive():
            break
        exits.append(w.wait(5))
    # Then it crashed the engine max_deliveries (3) times, each exit non-zero ...
    assert len(exits) == 3 and all(code != 0 for code in exits), exits
    # ... and the 4th delivery sent it to the dead-letter stream with error{poison}
    (letter, payload), = dead_letters(redis_client)
    assert (letter.code, letter.request_id, letter.deliveries) == ("poison", "poison-1", 4)
    assert b"POISON" in payload["json"]
    error = wait_terminal(redis_client, "poison-1")
    assert isinstance(error, protocol.Error) and (error.code, error.attempt) == ("poison", 4)
    assert [a for a, _ in started_by(redis_client, "poison-1")] == [1, 2, 3]
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")
    # And other requests flow through the same worker
    good = submit_all(redis_server.url, 1, max_tokens=3)[0]
    assert isinstance(wait_terminal(redis_client, good), protocol.Done)


def test_engine_fatal_error_exits_non_zero_and_a_peer_takes_over(redis_server, redis_client,
                                                                 workers) -> None:
    # Given a worker whose engine fails on its first step
    broken = workers("broken", fault="raise_in_step", lease=30.0, renew=1.0)
    broken.wait_ready(redis_client)
    rid = submit_all(redis_server.url, 1, max_tokens=4)[0]
    # When it meets the failure, it exits non-zero ...
    assert broken.wait(30) != 0
    # ... and a healthy peer (with a 30 s lease) takes the handed-back request right away
    workers("healthy", lease=30.0, renew=1.0).wait_ready(redis_client)
    done = wait_terminal(redis_client, rid, timeout=20)
    assert isinstance(done, protocol.Done) and done.attempt == 2
    assert started_by(redis_client, rid) == [(1, "broken"), (2, "healthy")]


def test_crash_between_terminal_and_ack_repeats_the_answer(redis_server, redis_client,
                                                           workers) -> None:
    # Given a worker that dies after writing a terminal event, before its XACK
    crashing = workers("crashing", fault="crash_after_terminal").wait_ready(redis_client)
    rid = submit_all(redis_server.url, 1, max_tokens=6)[0]
    assert crashing.wait(30) == 9
    # When a peer reclaims the unacked entry
    workers("peer").wait_ready(redis_client)
    wait_for(lambda: len(terminal_events(read_events(redis_client, rid))) == 2, 30,
             "the second attempt's terminal")
    # Then the client sees one terminal per attempt, the same answer twice, and the entry acked
    first, second = terminal_events(read_events(redis_client, rid))
    assert (first.attempt, second.attempt) == (1, 2)
    assert first.text == second.text
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")


def test_redis_restart_mid_run_is_survived(redis_server, redis_client, workers) -> None:
    # Given a worker streaming 20 generations
    w = workers("steady", fault="slow_step:20").wait_ready(redis_client)
    ids = submit_all(redis_server.url, 20, max_tokens=60)
    wait_for(lambda: any(isinstance(e, protocol.Delta) for rid in ids
                         for e in read_events(redis_client, rid)), 30, "the first delta")
    # When Redis stops (flushing its AOF) and comes back on the same folder 1.5 s later
    redis_server.stop()
    time.sleep(1.5)
    redis_server.restart()
    r = redis.Redis.from_url(redis_server.url)
    # Then every request completes, one terminal per attempt, the pending list drains, and the
    # worker is the same process
    for rid in ids:
        wait_terminal(r, rid, timeout=120)
        final = assert_one_terminal_per_attempt(r, rid)
        assert isinstance(final, protocol.Done), final
    wait_for(lambda: num_pending(r) == 0, 20, "the pending list to drain")
    assert w.alive(), w.log_tail()


def test_redis_restart_without_persistence_recreates_the_group(redis_server, redis_client,
                                                               workers) -> None:
    # Given a worker serving a long generation
    w = workers("steady", fault="slow_step:20").wait_ready(redis_client)
    running = submit_all(redis_server.url, 1, max_tokens=100)[0]
    wait_for(lambda: read_events(redis_client, running), 30, "the request to start")
    # When Redis comes back empty (no persistence): stream, group and results are gone
    redis_server.restart(wipe=True)
    r = redis.Redis.from_url(redis_server.url)
    # Then the worker recreates the group and serves new requests ...
    new = submit_all(redis_server.url, 1, max_tokens=4)[0]
    assert isinstance(wait_terminal(r, new, timeout=60), protocol.Done)
    assert any(g["name"] == GROUP.encode() for g in r.xinfo_groups(QUEUE_KEY))
    # ... the request it was running still finishes (its client may still be reading) ...
    assert isinstance(wait_terminal(r, running, timeout=60), protocol.Done)
    # ... and it never crash-looped
    assert w.alive(), w.log_tail()


def test_worker_started_before_redis_waits_not_ready_then_serves(redis_server, workers) -> None:
    # Given no Redis yet, and a worker started anyway
    redis_server.stop()
    port = free_port()
    w = workers("early", extra=["--metrics-port", str(port)])

    def readyz() -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0
    # Then it stays up, alive but not ready ...
    wait_for(lambda: readyz() == 503, 60, "/readyz to answer 503")
    time.sleep(1.0)
    assert w.alive() and readyz() == 503
    # ... and once Redis starts it becomes ready and serves
    redis_server.restart()
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    wait_for(lambda: readyz() == 200, 30, "/readyz to answer 200")
    rid = submit_all(redis_server.url, 1, max_tokens=3)[0]
    assert isinstance(wait_terminal(r, rid, timeout=30), protocol.Done)


def test_a_second_signal_exits_at_once(redis_server, redis_client, workers) -> None:
    # Given a worker draining long generations with a generous drain budget
    w = workers("impatient", fault="slow_step:40", drain=60.0).wait_ready(redis_client)
    ids = submit_all(redis_server.url, 2, max_tokens=200)
    wait_for(lambda: all(started_by(redis_client, rid) for rid in ids), 30, "both to start")
    w.signal(signal.SIGTERM)
    wait_for(lambda: "stopping: no new reads" in w.log_tail(), 10, "the first signal to land")
    # When a second signal comes
    w.signal(signal.SIGINT)
    # Then it exits at once, non-zero, without waiting out the drain budget ...
    assert w.wait(10) == 128 + signal.SIGINT
    # ... and a peer reruns its requests once the lease lapses
    workers("peer").wait_ready(redis_client)
    for rid in ids:
        final = wait_terminal(redis_client, rid, timeout=60)
        assert isinstance(final, protocol.Done) and final.attempt == 2
