"""llmq behind Sentinel: a primary, a replica and three sentinels (valkey 8.1 and redis-server 7.0,
each started with `--sentinel`).

Workers, the client and `llmq status` take `redis+sentinel://s1,s2,s3/llmq`; the primary is
SIGKILLed under load, the sentinels promote the replica, and everyone follows it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmq.broker import Client
from llmq.broker.connection import connect
from tests.fixtures.redis_servers import SERVER_KINDS
from tests.integration.worker_harness import WorkerProcess, wait_for, wait_terminal

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow]


def status(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "llmq.cli.main", "status", "--json",
                          "--redis-url", url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("sentinel_group", SERVER_KINDS, indirect=True)
def test_a_primary_killed_under_load_is_followed_to_its_replica(sentinel_group, tiny_model_path,
                                                                 tmp_path: Path):
    url = sentinel_group.url
    r = connect(url)
    old_primary = sentinel_group.primary()
    # Given a worker and `llmq status` on the Sentinel URL
    worker = WorkerProcess(url, tiny_model_path, tmp_path, "sw", fault="slow_step:10").start()
    try:
        worker.wait_ready(r)
        assert status(url)["primary"] == f"127.0.0.1:{old_primary.port}"
        submitted: dict[str, float] = {}

        def produce() -> None:
            with Client(url, retry_timeout=60) as client:
                for i in range(80):
                    rid = f"s-{i}"
                    client.submit(prompt_token_ids=[5, 6, 7], max_tokens=5, temperature=0,
                                  ignore_eos=True, request_id=rid)
                    submitted[rid] = time.monotonic()
                    time.sleep(0.03)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        wait_for(lambda: len(submitted) >= 20, 60, "20 submissions")
        # When the primary is SIGKILLed
        old_primary.kill()
        killed_at = time.monotonic()
        producer.join(180)
        # Then the sentinels promote the replica and `llmq status` names it
        wait_for(lambda: sentinel_group.primary().port != old_primary.port, 30,
                 "a new primary")
        new_primary = sentinel_group.primary()
        assert status(url)["primary"] == f"127.0.0.1:{new_primary.port}"
        # And every request ends, except ones written just before the kill (async replication)
        lost = []
        for rid in submitted:
            try:
                wait_terminal(r, rid, timeout=60)
            except AssertionError:
                lost.append(rid)
        assert all(killed_at - 1.0 <= submitted[rid] <= killed_at + 0.5 for rid in lost), lost
        assert len(lost) <= 5, lost
        print(f"sentinel failover: {len(submitted)} submitted, {len(lost)} lost in the window")
        assert worker.alive()
    finally:
        worker.stop()
        r.close()
