"""`llmq batch` and `llmq serve` on a Redis Cluster (3 masters + 3 replicas).

rq cannot use a cluster, so the batch jobs' rq queue lives on a plain server named by
`LLMQ_RQ_REDIS_URL`, while every request and result goes through the cluster.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.cli_harness import llmq, ok, one_error_line
from tests.e2e.gateway_harness import KEYS as API_KEYS
from tests.e2e.gateway_harness import GatewayProcess
from tests.integration.worker_harness import KEYS, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def cluster_worker(cluster, tiny_model_path: Path, tmp_path: Path):
    worker = WorkerProcess(cluster.url, tiny_model_path, tmp_path, "fw").start()
    client = cluster.client()
    try:
        yield worker.wait_ready(client)
    finally:
        worker.stop()
        client.close()


def test_llmq_batch_runs_through_the_cluster_with_rq_beside_it(cluster, cluster_worker,
                                                               valkey_server, valkey_client,
                                                               tmp_path: Path) -> None:
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text("\n".join(json.dumps({
        "custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "tiny-llama.gguf", "prompt": "Once", "max_tokens": 3,
                 "ignore_eos": True}})
        for i in range(4)) + "\n")
    # Given no rq server: batches refuse to start, saying what to set
    assert "LLMQ_RQ_REDIS_URL" in one_error_line(llmq("batch", "submit", str(batch_file),
                                                      url=cluster.url))
    rq_env = {"LLMQ_RQ_REDIS_URL": valkey_server.url}
    # When rq gets a plain server of its own
    batch_id = ok(llmq("batch", "submit", str(batch_file), url=cluster.url,
                       env=rq_env)).stdout.strip()
    ok(llmq("batch-worker", "--burst", url=cluster.url, env=rq_env))
    # Then the batch completes, its lines answered through the cluster
    status = json.loads(ok(llmq("batch", "status", batch_id, "--json", url=cluster.url,
                                env=rq_env)).stdout)
    assert status["status"] == "completed", status
    assert status["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    out = tmp_path / "out.jsonl"
    ok(llmq("batch", "results", batch_id, "-o", str(out), url=cluster.url, env=rq_env))
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        "c0", "c1", "c2", "c3"]
    # And rq's keys are on the plain server, llmq's on the cluster
    assert valkey_client.keys("rq:*")
    assert not valkey_client.keys("llmq:*")
    with cluster.client() as rc:
        assert rc.exists(KEYS.batch_output(batch_id))


def test_the_gateway_streams_an_answer_from_the_cluster(cluster, cluster_worker,
                                                        tmp_path: Path) -> None:
    gateway = GatewayProcess(cluster.url, tmp_path).start()
    try:
        # When a client streams a chat completion through the gateway
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEYS['alice']}"},
                          json={"model": "tiny-llama.gguf", "stream": True, "max_tokens": 5,
                                "ignore_eos": True,
                                "messages": [{"role": "user", "content": "Hi"}]}) as reply:
            assert reply.status_code == 200
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        # Then the answer streams and ends, its events read from the cluster
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length"
                   for c in chunks)
    finally:
        gateway.stop()
