"""`llmq serve` as deploy/acl.conf's `gateway` user: every route works within its rights.

The server is the one test_acl.py starts (deploy/redis.conf + deploy/acl.conf, both server
kinds); the worker runs as `worker`, the batch worker as `gateway` too.
"""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
import redis

from llmq.broker.keys import Keys
from llmq.protocol import DeadLetter, encode_dead_letter
from tests.e2e.cli_harness import llmq, ok
from tests.e2e.gateway_harness import KEYS, GatewayProcess
from tests.fixtures.acl_server import PASSWORDS, acl_url
from tests.integration.worker_harness import InProcessWorker

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_every_route_works_as_the_gateway_acl_user(acl_server, tiny_model, tmp_path) -> None:
    port, _ = acl_server
    admin = redis.Redis(port=port, username="admin", password=PASSWORDS["admin"])
    admin.flushall()
    # the deploy step: only the admin may load the function library
    ok(llmq("admin", "load-functions", url=acl_url(port, "admin")))
    gateway = GatewayProcess(acl_url(port, "gateway"), tmp_path,
                             extra=["--admin-tenant", "alice", "--dashboard-interval", "1"])
    try:
        with InProcessWorker(acl_url(port, "worker"), tiny_model, worker_id="acl-gw-worker"):
            gateway.start()
            client = gateway.openai()
            # models, answers streamed and not, a resume and a cancel
            assert [m.id for m in client.models.list().data] == ["tiny"]
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                extra_headers={"X-Request-Id": "acl-1"})
            assert answer.choices[0].finish_reason in ("stop", "length")
            chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=3,
                                                    stream=True))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            auth = {"Authorization": f"Bearer {KEYS['alice']}"}
            resumed = httpx.get(f"{gateway.base_url}/v1/chat/completions/acl-1/stream",
                                headers=auth)
            assert resumed.status_code == 200 and "[DONE]" in resumed.text
            assert httpx.post(f"{gateway.base_url}/v1/chat/completions/acl-1/cancel",
                              headers=auth).status_code == 200
            # a conversation through the Responses API, and several prompts in one body
            first = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
            second = client.responses.create(model="tiny", input="Go on", max_output_tokens=2,
                                             previous_response_id=first.id)
            assert client.responses.retrieve(second.id).id == second.id
            several = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2)
            assert len(several.choices) == 2
            # files and a batch, run by a batch worker, then its output
            data = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}})
            file_id = client.files.create(file=("b.jsonl", io.BytesIO(data.encode())),
                                          purpose="batch").id
            assert [f.id for f in client.files.list()] == [file_id]
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                          completion_window="24h")
            ok(llmq("batch-worker", "--burst", url=acl_url(port, "gateway")))
            batch = client.batches.retrieve(batch.id)
            assert batch.status == "completed", batch
            output = client.files.content(batch.output_file_id).text
            assert json.loads(output.split("\n")[0])["custom_id"] == "a"
            queued = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                           completion_window="24h")
            assert client.batches.cancel(queued.id).status == "cancelled"
            assert len(client.batches.list().data) == 2
            assert httpx.get(f"{gateway.base_url}/metrics", headers=auth).status_code == 200
            # the dashboard: the pool, its charts, a dead letter retried, the rest purged
            dash = f"{gateway.base_url}/dashboard/api"
            assert httpx.get(f"{dash}/pool", headers=auth).json()["workers"]
            for request_id in ("alice:dl-1", "alice:dl-2"):
                letter = DeadLetter(queue="default", entry_id="1-0", request_id=request_id,
                                    code="poison", message="test")
                admin.xadd(Keys().dlq("default"), encode_dead_letter(letter, {
                    "json": json.dumps({"id": request_id, "prompt": "Hi", "max_tokens": 2})}))
            letters = httpx.get(f"{dash}/dead-letters", headers=auth).json()["dead_letters"]
            assert len(letters) == 2
            assert httpx.post(f"{dash}/dead-letters/default/{letters[0]['dlq_entry_id']}/retry",
                              headers=auth).status_code == 200
            assert httpx.post(f"{dash}/dead-letters/default/purge",
                              headers=auth).json()["purged"] == 1
            time.sleep(2.5)  # a sample or two of the charts
            assert httpx.get(f"{dash}/series", headers=auth).json()["samples"]
            with httpx.stream("GET", f"{dash}/requests/alice:acl-1/events", headers=auth) as s:
                assert any('"type":"done"' in line for line in s.iter_lines())
            assert httpx.post(f"{dash}/requests/alice:acl-1/cancel",
                              headers=auth).status_code == 200
        # nothing the gateway did was refused
        time.sleep(0.2)
        assert "NOPERM" not in gateway.log_tail(400) and "no permissions" not in \
            gateway.log_tail(400)
    finally:
        gateway.stop()
        admin.flushall()
        admin.close()
