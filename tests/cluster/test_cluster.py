"""llmq on a real Redis Cluster: 3 masters + 3 replicas (valkey 8.1 and redis-server 7.0).

The same worker processes, clients and tiny random Llama as the single-server suites, pointed at
`redis+cluster://...`: submit and stream, a raw XADD producer, cancel, reclaim after SIGKILL, dead
letters, drain; result streams spread over all three masters; a master SIGKILLed mid-run (its
replica takes over, the loss window is counted); a busy queue's slot migrated while it runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from llmq.broker.keys import GROUP
from tests.fixtures.redis_cluster import ClusterServers, _cli
from tests.integration.worker_harness import (
    KEYS,
    QUEUE_KEY,
    WorkerProcess,
    dead_letters,
    num_pending,
    read_events,
    terminal_events,
    wait_for,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def rc(cluster: ClusterServers):
    client = cluster.client()
    yield client
    client.close()


@pytest.fixture
def workers(cluster: ClusterServers, tiny_model_path: Path, tmp_path: Path):
    started: list[WorkerProcess] = []

    def make(worker_id: str, **kwargs) -> WorkerProcess:
        w = WorkerProcess(cluster.url, tiny_model_path, tmp_path, worker_id, **kwargs)
        started.append(w)
        return w.start()

    yield make
    for w in started:
        w.stop()


def requests(n: int, **params) -> list[dict]:
    return [{"prompt_token_ids": [7 + i % 40, 3, 5], "temperature": 0, "ignore_eos": True,
             **params} for i in range(n)]


def one_terminal_per_attempt(r, request_id: str) -> protocol.Event:
    terminals = terminal_events(read_events(r, request_id))
    attempts = [t.attempt for t in terminals]
    assert len(attempts) == len(set(attempts)), terminals
    return max(terminals, key=lambda t: t.attempt)


def master_of(rc, key: str) -> str:
    return rc.get_node_from_key(key).name


def test_two_hundred_requests_spread_over_every_master_and_all_finish(cluster, rc, workers):
    # Given two workers on the cluster URL
    for name in ("a", "b"):
        workers(name, max_num_seqs=32).wait_ready(rc)
    # When 200 requests are submitted in one call (the submit function, pipelined per node)
    with Client(cluster.url) as client:
        ids = client.submit_many(requests(200, max_tokens=4))
        group = client.follow_many(ids)
        ended = {}
        deadline = time.monotonic() + 120
        while group and time.monotonic() < deadline:
            for transcript in group.poll(block_ms=500):
                ended[transcript.request_id] = transcript
    # Then every one ended with its answer, followed through the client's reader
    assert len(ended) == 200
    assert all(isinstance(t.final, protocol.Done) and t.final.usage.completion_tokens == 4
               for t in ended.values())
    # And the result streams landed on all three masters, the queue on one
    masters = {master_of(rc, KEYS.result(rid)) for rid in ids}
    assert len(masters) == 3
    wait_for(lambda: num_pending(rc) == 0, 10, "the pending list to drain")


def test_raw_xadd_cancel_and_dead_letters(cluster, rc, workers):
    workers("a", fault="slow_step:30").wait_ready(rc)
    # Given a producer with nothing but a cluster client: one raw XADD
    rc.xadd(QUEUE_KEY, {"json": json.dumps({"id": "raw-1", "prompt_token_ids": [5, 6],
                                            "max_tokens": 3, "temperature": 0,
                                            "ignore_eos": True})})
    done = wait_terminal(rc, "raw-1")
    assert isinstance(done, protocol.Done) and done.usage.completion_tokens == 3
    # And an entry no worker can decode
    bad = rc.xadd(QUEUE_KEY, {"json": b'{"prompt": "trunc'}).decode()
    wait_for(lambda: dead_letters(rc), 30, "the dead letter")
    (letter, _), = dead_letters(rc)
    assert (letter.code, letter.entry_id) == ("invalid_request", bad)
    # When a long generation is cancelled mid-stream
    with Client(cluster.url) as client:
        rid = client.submit(prompt_token_ids=[5, 6], max_tokens=200, ignore_eos=True,
                            request_id="long-1")
        wait_for(lambda: any(isinstance(e, protocol.Delta) for e in read_events(rc, rid)), 30,
                 "the first delta")
        client.cancel(rid)
        # Then it ends as cancelled
        result = client.result(rid, timeout=30)
    assert result.finish_reason == "cancelled"
    assert result.usage.completion_tokens < 200
    wait_for(lambda: num_pending(rc) == 0, 10, "the pending list to drain")


def test_sigkill_and_drain_lose_nothing(cluster, rc, workers):
    # Given two workers sharing slow generations
    victim = workers("victim", fault="slow_step:20", max_num_seqs=8).wait_ready(rc)
    survivor = workers("survivor", fault="slow_step:20", max_num_seqs=8)
    survivor.wait_ready(rc)
    with Client(cluster.url) as client:
        ids = client.submit_many(requests(24, max_tokens=20))
    wait_for(lambda: any(e.worker == "victim" for rid in ids for e in read_events(rc, rid)
                         if isinstance(e, protocol.Start)), 60, "the victim to start one")
    # When one is SIGKILLed and then the other is told to drain and a third takes over
    victim.kill()
    wait_for(lambda: any(t.attempt == 2 for rid in ids
                         for t in terminal_events(read_events(rc, rid))), 60,
             "a reclaimed request to finish")
    workers("third", fault="slow_step:5", max_num_seqs=8).wait_ready(rc)
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(30) == 0, survivor.log_tail()
    # Then every request ends with one terminal per attempt, a whole answer
    for rid in ids:
        wait_terminal(rc, rid, timeout=120)
        final = one_terminal_per_attempt(rc, rid)
        assert isinstance(final, protocol.Done) and final.usage.completion_tokens == 20
    wait_for(lambda: num_pending(rc) == 0, 10, "the pending list to drain")


def test_master_sigkill_mid_run_loses_only_inside_the_window(cluster, rc, workers):
    # Given two workers and a producer submitting steadily
    pool = [workers(name, fault="slow_step:10", max_num_seqs=16).wait_ready(rc)
            for name in ("a", "b")]
    submitted: dict[str, float] = {}
    stop = threading.Event()

    def produce() -> None:
        with Client(cluster.url, retry_timeout=30) as client:
            for i in range(120):
                if stop.is_set():
                    return
                rid = f"fo-{i}"
                client.submit(prompt_token_ids=[5, 6, 7], max_tokens=6, temperature=0,
                              ignore_eos=True, request_id=rid)
                submitted[rid] = time.monotonic()
                time.sleep(0.03)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    wait_for(lambda: len(submitted) >= 30, 60, "30 submissions")
    # When the master holding the queue's slot is SIGKILLed
    victim = next(n for n in cluster.masters() if n.port == rc.get_node_from_key(
        QUEUE_KEY).port)
    victim.kill()
    killed_at = time.monotonic()
    producer.join(120)
    stop.set()
    # Then its replica takes over and the cluster is whole again within seconds
    cluster.wait_ok(timeout=30)
    assert len(cluster.masters()) == 3
    # And every request ends with a terminal event, except ones written just before the kill
    # (asynchronous replication: acknowledged writes not yet on the replica are lost)
    lost = []
    for rid in submitted:
        try:
            wait_terminal(rc, rid, timeout=60)
        except AssertionError:
            lost.append(rid)
    window = [submitted[rid] for rid in lost]
    assert all(killed_at - 1.0 <= t <= killed_at + 0.5 for t in window), (lost, killed_at)
    assert len(lost) <= 5, lost
    print(f"failover: {len(submitted)} submitted, {len(lost)} lost inside the 1 s window")
    # And the workers rode it out (MOVED, CLUSTERDOWN, refused connections: never a crash)
    assert all(w.alive() for w in pool), [w.log_tail() for w in pool]
    # And the client can resubmit those with the same ids
    with Client(cluster.url) as client:
        for rid in lost:
            rc.delete(KEYS.idempotency("default", rid))
            client.submit(prompt_token_ids=[5, 6, 7], max_tokens=6, request_id=rid)
        for rid in lost:
            client.result(rid, timeout=60)


def test_the_queue_slot_migrates_while_requests_run(cluster, rc, workers):
    worker = workers("a", fault="slow_step:10", max_num_seqs=16).wait_ready(rc)
    slot = rc.keyslot(QUEUE_KEY)
    source = rc.get_node_from_key(QUEUE_KEY)
    target = next(n for n in rc.get_primaries() if n.name != source.name)
    ids: list[str] = []

    def produce() -> None:
        with Client(cluster.url, retry_timeout=30) as client:
            for i in range(60):
                ids.append(client.submit(prompt_token_ids=[5, 6], max_tokens=4, temperature=0,
                                         ignore_eos=True, request_id=f"mig-{i}"))
                time.sleep(0.02)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    wait_for(lambda: len(ids) >= 10, 30, "10 submissions")
    # When the queue's slot moves to another master mid-run
    subprocess.run([_cli(), "--cluster", "reshard", f"127.0.0.1:{source.port}",
                    "--cluster-from", _node_id(source), "--cluster-to", _node_id(target),
                    "--cluster-slots", "1", "--cluster-yes"],
                   check=False, capture_output=True, timeout=60)
    if rc.get_node_from_key(QUEUE_KEY).name == source.name:
        # reshard moves the first slots of the source, not ours: move ours explicitly
        _migrate_slot(source, target, slot)
    producer.join(60)
    # Then the slot is served by the other master and every request finished
    cluster.wait_ok()
    fresh = cluster.client()
    try:
        assert fresh.get_node_from_key(QUEUE_KEY).port == target.port
        for rid in ids:
            assert isinstance(wait_terminal(fresh, rid, timeout=60), protocol.Done)
        assert fresh.xinfo_groups(QUEUE_KEY)[0]["name"] == GROUP.encode()
        # And the worker followed the slot (ASK during the move, MOVED after), still alive
        assert worker.alive(), worker.log_tail()
    finally:
        fresh.close()


def _node_id(node) -> str:
    with redis.Redis(host=node.host, port=node.port) as r:
        return r.execute_command("CLUSTER", "MYID").decode()


def _migrate_slot(source, target, slot: int) -> None:
    """The steps of `redis-cli --cluster reshard` for one slot, as the Redis docs give them."""
    src = redis.Redis(host=source.host, port=source.port)
    dst = redis.Redis(host=target.host, port=target.port)
    src_id, dst_id = _node_id(source), _node_id(target)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while True:
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        if not keys:
            break
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
    for r in (dst, src):
        r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    src.close()
    dst.close()
