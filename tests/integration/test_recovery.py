"""Recovery in seconds, never a takeover during a Redis-wide stall, and poison isolation.

`llmq worker` processes on the tiny random Llama. Times come from a recorded timeline in the
server's clock (result stream entry ids, and `TIME` just before a kill), asserted against the
bound the worker's defaults imply (`WorkerConfig.takeover_bound`), never against how fast this
machine happens to be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from llmq.protocol import parse_entry_id
from llmq.worker.worker_config import WorkerConfig
from tests.integration.worker_harness import (
    KEYS,
    WorkerProcess,
    dead_letters,
    num_pending,
    read_events,
    terminal_events,
    wait_for,
    wait_terminal,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

DEFAULT_TIMING = {"lease": None, "renew": None, "heartbeat": None}


@pytest.fixture
def workers(redis_server, tiny_model_path: Path, tmp_path: Path):
    """Factory of worker processes; `.started` maps their ids to them. All stopped at the end."""
    started: dict[str, WorkerProcess] = {}

    def make(worker_id: str, **kwargs) -> WorkerProcess:
        w = WorkerProcess(redis_server.url, tiny_model_path, tmp_path, worker_id, **kwargs)
        started[worker_id] = w
        return w.start()

    make.started = started  # type: ignore[attr-defined]
    yield make
    for w in started.values():
        w.stop()


def timeline(r: redis.Redis, request_id: str) -> list[tuple[int, protocol.Event]]:
    """(server ms the event was written, event) for every event of a request, in order."""
    return [(parse_entry_id(entry_id)[0], protocol.decode_event(fields))
            for entry_id, fields in r.xrange(KEYS.result(request_id))]


def server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def starts(r: redis.Redis, request_id: str) -> list[protocol.Start]:
    return [e for e in read_events(r, request_id) if isinstance(e, protocol.Start)]


def test_a_sigkilled_workers_request_restarts_within_the_default_bound(
        redis_server, redis_client, workers) -> None:
    # Given two workers with every timing at its default (heartbeat 5 s, lease 30 s)
    for name in ("w1", "w2"):
        workers(name, fault="slow_step:25", **DEFAULT_TIMING).wait_ready(redis_client)
    with Client(redis_server.url) as client:
        rid = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=40, ignore_eos=True,
                            temperature=0, request_id="killed-1")
    wait_for(lambda: any(isinstance(e, protocol.Delta) for e in read_events(redis_client, rid)),
             30, "a first token")
    (first,) = starts(redis_client, rid)
    # When the worker running it is SIGKILLed
    killed_ms = server_ms(redis_client)
    workers.started[first.worker].kill()
    # Then a peer starts it again as attempt 2 within the defaults' takeover bound, and the
    # whole answer is there less than 10 s after the kill
    done = wait_terminal(redis_client, rid, timeout=60)
    assert isinstance(done, protocol.Done) and done.attempt == 2, done
    events = timeline(redis_client, rid)
    restart_ms = next(ms for ms, e in events if isinstance(e, protocol.Start) and e.attempt == 2)
    done_ms = next(ms for ms, e in events if e == done)
    bound = WorkerConfig(worker_id="defaults").takeover_bound
    print(f"SIGKILL at {killed_ms}: attempt 2 started after {restart_ms - killed_ms} ms, done "
          f"after {done_ms - killed_ms} ms (bound {bound:g} s)")
    assert bound < 10
    assert (restart_ms - killed_ms) / 1000 <= bound, (restart_ms - killed_ms, bound)
    assert (done_ms - killed_ms) / 1000 < 10, done_ms - killed_ms
    assert done.usage.completion_tokens == 40


def test_a_redis_wide_pause_longer_than_the_lease_takes_nothing(
        redis_server, redis_client, workers) -> None:
    # Given two workers with a 10 s lease (5 s heartbeat) running eight long generations
    for name in ("p1", "p2"):
        workers(name, fault="slow_step:100", lease=10.0, renew=None, heartbeat=None,
                max_num_seqs=16).wait_ready(redis_client)
    with Client(redis_server.url) as client:
        ids = client.submit_many([{"prompt_token_ids": [5 + i, 6, 7], "max_tokens": 250,
                                   "ignore_eos": True} for i in range(8)])
    wait_for(lambda: all(starts(redis_client, rid) for rid in ids), 30, "all to start")
    # When Redis pauses every write for 15 s (past the lease and every heartbeat's TTL)
    redis_client.execute_command("CLIENT", "PAUSE", "15000", "WRITE")
    # Then once it resumes, every owner renews before any peer may take over: each request
    # runs to the end as attempt 1, with one start and one done
    for rid in ids:
        done = wait_terminal(redis_client, rid, timeout=120)
        assert isinstance(done, protocol.Done) and done.attempt == 1, done
        assert [s.attempt for s in starts(redis_client, rid)] == [1]
        assert terminal_events(read_events(redis_client, rid)) == [done]
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")
    for w in workers.started.values():
        assert w.alive() and "took " not in w.log_tail(400), w.log_tail()


def test_after_an_engine_failure_only_the_poison_request_is_dead_lettered(
        redis_server, redis_client, workers) -> None:
    # Given a request that crashes the engine (TEST-ONLY fault) queued with 5 batch-mates
    with Client(redis_server.url) as client:
        mates = client.submit_many([{"prompt": f"batch-mate number {i}", "max_tokens": 6,
                                     "temperature": 0} for i in range(3)])
        poison = client.submit("this one is POISON", request_id="poison-1", max_tokens=6)
        mates += client.submit_many([{"prompt": f"batch-mate number {i}", "max_tokens": 6,
                                      "temperature": 0} for i in range(3, 5)])
    # When one worker reads all six into one batch and its engine fails, and the worker is
    # restarted whenever it exits (as Kubernetes restarts a pod)
    exits = []
    for n in range(1, 6):
        w = workers(f"restarting-{n}", fault="raise_in_step:POISON")
        wait_for(lambda w=w: not w.alive() or (
            dead_letters(redis_client) and all(terminal_events(read_events(redis_client, m))
                                               for m in mates)), 60, "a crash or the end")
        if w.alive():
            break
        exits.append(w.wait(5))
    # Then the batch-mates ran alone on their next delivery and finished as attempt 2
    for rid in mates:
        done = wait_terminal(redis_client, rid)
        assert isinstance(done, protocol.Done) and done.attempt == 2, done
        assert [s.attempt for s in starts(redis_client, rid)] == [1, 2]
    # ... while the poison request alone crashed the engine until max_deliveries (3) and went
    # to the dead-letter stream
    assert len(exits) == 3 and all(code != 0 for code in exits), exits
    (letter, _), = dead_letters(redis_client)
    assert (letter.code, letter.request_id) == ("poison", poison)
    error = wait_terminal(redis_client, poison)
    assert isinstance(error, protocol.Error) and (error.code, error.attempt) == ("poison", 4)
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the pending list to drain")
