"""Utility calls over `llmq:ctl:{<queue>}` against two real worker processes: reset the prefix
cache, sleep (memory freed, nothing read, KEDA's lag still counting), wake, profile, stats, and an
unknown call. Both workers run the tiny model with a 128 MB KV cache, so freeing it shows in RSS.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from click.testing import CliRunner

from llmq import protocol
from llmq.broker import Client
from llmq.broker.control import call_workers
from llmq.broker.embedded import free_port
from llmq.broker.keys import GROUP
from llmq.cli.main import cli
from tests.integration.worker_harness import (
    QUEUE_KEY,
    WorkerProcess,
    read_events,
    wait_for,
    wait_terminal,
    xadd_json,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KV = str(128 << 20)
PROMPT = list(range(100, 150))  # 50 tokens: three full 16-token blocks to cache


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def run_greedy(r, request_id: str) -> protocol.Done:
    xadd_json(r, {"id": request_id, "prompt_token_ids": PROMPT, "max_tokens": 4,
                  "temperature": 0})
    done = wait_terminal(r, request_id)
    assert isinstance(done, protocol.Done), done
    return done


@pytest.fixture
def two_workers(redis_server, redis_client, tiny_model_path, tmp_path):
    port = free_port()
    workers = [
        WorkerProcess(redis_server.url, tiny_model_path, tmp_path, "w1",
                      extra=["--kv-cache-memory-bytes", KV, "--metrics-port", str(port)]),
        WorkerProcess(redis_server.url, tiny_model_path, tmp_path, "w2",
                      extra=["--kv-cache-memory-bytes", KV])]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(redis_client)
        yield workers, port
    finally:
        for w in workers:
            w.stop()


def test_utility_calls_against_two_workers(redis_server, redis_client, two_workers):
    (w1, w2), port = two_workers
    client = Client(redis_server.url)
    try:
        # Given two workers; When w2 is put to sleep at level 1
        before = rss_mib(w2.pid)
        (reply,) = call_workers(client, "sleep", {"level": 1}, worker="w2")
        # Then it answers, its KV cache's memory is gone, and it shows as sleeping
        assert reply.ok and reply.worker == "w2" and reply.result["level"] == 1
        assert before - rss_mib(w2.pid) > 100
        wait_for(lambda: {w.worker_id: w.sleeping for w in client.workers()} == {"w1": 0, "w2": 1},
                 10, "the heartbeats to show w2 sleeping")
        status = CliRunner().invoke(cli, ["status", "--redis-url", redis_server.url])
        assert "sleeping (level 1)" in status.output

        # When w1 (the only one reading now) serves one prompt twice
        first, second = run_greedy(redis_client, "p1"), run_greedy(redis_client, "p2")
        assert second.usage.cached_prompt_tokens == 48 and second.text == first.text
        # And the prefix caches are reset (every worker answers, the sleeping one too)
        replies = call_workers(client, "reset_prefix_cache")
        assert sorted((r.worker, r.ok, r.result["reset"]) for r in replies) == [
            ("w1", True, True), ("w2", True, True)]
        # Then the same prompt finds nothing cached
        assert run_greedy(redis_client, "p3").usage.cached_prompt_tokens == 0

        # When w1 sleeps too (through the CLI), a request waits unread, visible as lag
        slept = CliRunner().invoke(cli, ["admin", "sleep", "--worker", "w1",
                                         "--redis-url", redis_server.url])
        assert slept.exit_code == 0 and "w1: ok level=1" in slept.output
        assert readyz(port) == (503, "sleeping (level 1)\n")
        xadd_json(redis_client, {"id": "waits", "prompt": "Hi", "max_tokens": 3})
        wait_for(lambda: redis_client.xinfo_groups(QUEUE_KEY)[0]["lag"] == 1, 5,
                 "the group lag to count the unread request")
        assert read_events(redis_client, "waits") == []
        # When w1 wakes, it serves the waiting request and is ready again
        (woken,) = call_workers(client, "wake_up", worker="w1")
        assert woken.ok and woken.result["was_sleeping"] == 1
        assert isinstance(wait_terminal(redis_client, "waits"), protocol.Done)
        wait_for(lambda: readyz(port)[0] == 200, 10, "/readyz to be ready again")

        # When w1 is profiled over one request
        assert call_workers(client, "profile", {"action": "start"}, worker="w1")[0].ok
        run_greedy(redis_client, "profiled")
        (stopped,) = call_workers(client, "profile", {"action": "stop"}, worker="w1")
        # Then it answers where the trace is, and the trace is a Chrome trace of that work
        trace = stopped.result["trace"]
        assert os.path.getsize(trace) > 0 and "traceEvents" in json.load(open(trace))

        # And stats come from both, an unknown call gets an error from both
        stats = {r.worker: r.result for r in call_workers(client, "stats")}
        assert stats["w1"]["sleeping"] == 0 and stats["w2"]["sleeping"] == 1
        unknown = call_workers(client, "explode")
        assert sorted(r.worker for r in unknown) == ["w1", "w2"]
        assert all(not r.ok and "unknown method 'explode'" in r.error for r in unknown)
        assert redis_client.xpending(QUEUE_KEY, GROUP)["pending"] == 0
    finally:
        client.close()


def test_a_worker_put_to_sleep_hands_its_running_request_to_a_peer(redis_server, redis_client,
                                                                   tiny_model):
    from tests.integration.worker_harness import InProcessWorker

    client = Client(redis_server.url)
    # Given one worker running a long request (slowed down), and no peer yet
    with InProcessWorker(redis_server.url, tiny_model, worker_id="busy",
                         fault="slow_step:20") as busy:
        xadd_json(redis_client, {"id": "long", "prompt": "Hi", "max_tokens": 100,
                                 "ignore_eos": True, "temperature": 0})
        wait_for(lambda: len(read_events(redis_client, "long")) >= 3, 30, "it to stream")
        # When it is put to sleep
        (reply,) = call_workers(client, "sleep", {"level": 1}, worker="busy")
        assert reply.ok and reply.result["handed_back"] == 1
        assert busy.engine.sleep_level == 1 and not busy.engine.has_unfinished_requests()
        # Then a peer that starts takes the request over at once and finishes it
        with InProcessWorker(redis_server.url, tiny_model, worker_id="peer"):
            done = wait_terminal(redis_client, "long")
    client.close()
    assert isinstance(done, protocol.Done) and done.attempt == 2
    assert done.usage.completion_tokens == 100
    # And the sleeping worker wrote no terminal event for its attempt, nor acked it
    assert redis_client.xpending(QUEUE_KEY, GROUP)["pending"] == 0
    terminals = [e for e in read_events(redis_client, "long") if protocol.is_terminal(e)]
    assert [e.attempt for e in terminals] == [2]
