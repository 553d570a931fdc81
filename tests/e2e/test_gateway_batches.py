"""The OpenAI Batch API through the official SDK, on real `llmq serve`, `llmq batch-worker` and
tiny-model `llmq worker` processes; and tenants kept apart (requests, files, batches)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from llmq.broker.keys import Keys
from tests.e2e.cli_harness import llmq_process, serve, subprocess_env
from tests.e2e.gateway_harness import KEYS, GatewayProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    line("a", "/v1/chat/completions", {"model": "tiny-llama.gguf", "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "Hi"}]}),
    line("b", "/v1/chat/completions", {"model": "tiny-llama.gguf", "max_tokens": 3,
                                       "ignore_eos": True,
                                       "messages": [{"role": "user", "content": "Yo"}]}),
    line("bad", "/v1/chat/completions", {"model": "tiny-llama.gguf", "temperature": 7,
                                         "messages": [{"role": "user", "content": "x"}]}),
]


class BatchWorkers:
    """The `llmq batch-worker` processes of the module: started, killed and stopped by PID."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url, self.logs = url, logs
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> subprocess.Popen[str]:
        with open(self.logs / f"batch-worker-{len(self.procs)}.log", "ab") as log:
            proc = llmq_process("batch-worker", env=subprocess_env(self.url), stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen[str]) -> str:
        return (self.logs / f"batch-worker-{self.procs.index(proc)}.log").read_text(
            errors="replace")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()  # our own children, by PID
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def children(pid: int) -> list[int]:
    """The child processes of `pid` (an rq worker's work horse)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module")
def batch_workers(valkey_server, tmp_path_factory) -> Iterator[BatchWorkers]:
    workers = BatchWorkers(valkey_server.url, tmp_path_factory.mktemp("batch-workers"))
    workers.start()
    try:
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def pool(valkey_server, tiny_model_path: Path, tmp_path_factory, batch_workers: BatchWorkers
         ) -> Iterator[tuple[GatewayProcess, redis.Redis]]:
    logs = tmp_path_factory.mktemp("gateway-batches")
    worker = serve(valkey_server.url, tiny_model_path, logs, "gw-batch-w1")
    gateway = GatewayProcess(valkey_server.url, logs)
    r = redis.Redis.from_url(valkey_server.url)
    try:
        yield gateway.start(), r
    finally:
        r.close()
        gateway.stop()
        worker.stop()


def jsonl(text: str) -> list[dict]:
    # NOTE: "\n" only: str.splitlines() would also cut at U+2028, which a random model may write.
    return [json.loads(x) for x in text.split("\n") if x]


def upload(client: openai.OpenAI, lines: list[str]) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "failed", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.25)


def test_a_batch_runs_end_to_end_through_the_sdk(pool) -> None:
    gateway, _ = pool
    client = gateway.openai()
    # Given an uploaded batch file
    file_id = upload(client, LINES)
    stored = client.files.retrieve(file_id)
    assert stored.purpose == "batch" and stored.filename == "batch.jsonl"
    assert client.files.content(file_id).text.count("custom_id") == 3
    # When a batch is created on it and polled to the end
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "e2e"}
    batch = wait_final(client, batch.id)
    # Then it completed with OpenAI's counts
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (3, 2, 1)
    # And its output file has the answers in input order, its error file the bad line
    outputs = jsonl(client.files.content(batch.output_file_id).text)
    assert [o["custom_id"] for o in outputs] == ["a", "b"]
    assert outputs[1]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert outputs[0]["response"]["body"]["object"] == "chat.completion"
    assert not any("alice" in o["id"] or "alice" in o["response"]["request_id"]
                   for o in outputs)
    errors = jsonl(client.files.content(batch.error_file_id).text)
    assert [e["custom_id"] for e in errors] == ["bad"] and "temperature" in errors[0][
        "error"]["message"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    # And it is listed
    assert batch.id in [b.id for b in client.batches.list()]


def test_a_batch_can_be_cancelled(pool) -> None:
    gateway, r = pool
    client = gateway.openai()
    # Given a batch of many long requests, running
    lines = [line(f"c{i}", "/v1/completions", {"model": "tiny-llama.gguf", "prompt": "x",
                                               "max_tokens": 200, "ignore_eos": True})
             for i in range(300)]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.1)
    # When it is cancelled
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    # Then it ends cancelled, every line accounted for, not all of them run
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled"
    counts = batch.request_counts
    assert counts.completed + counts.failed == 300 and counts.completed < 300


def test_tenants_see_only_their_own_files_batches_and_requests(pool) -> None:
    gateway, r = pool
    alice, bob = gateway.openai("alice"), gateway.openai("bob")
    file_id = upload(alice, LINES[:1])
    batch = alice.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    # Bob cannot read, download, use or delete Alice's file...
    for call in (lambda: bob.files.retrieve(file_id), lambda: bob.files.content(file_id),
                 lambda: bob.files.delete(file_id),
                 lambda: bob.batches.create(input_file_id=file_id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in bob.files.list()]
    # ...nor see or cancel her batch
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list()]
    # And the same X-Request-Id is two requests, one per tenant, neither reading the other's
    for tenant in ("alice", "bob"):
        gateway.openai(tenant).completions.create(
            model="tiny-llama.gguf", prompt=f"I am {tenant}", max_tokens=2,
            extra_headers={"X-Request-Id": "shared-id"})
    keys = Keys()
    assert r.exists(keys.result("alice:shared-id")) and r.exists(keys.result("bob:shared-id"))
    assert b"I am bob" not in b"".join(
        v for _, f in r.xrange(keys.result("alice:shared-id")) for v in f.values())
    assert wait_final(alice, batch.id).status == "completed"


def failed_batch(client: openai.OpenAI, data: bytes, endpoint: str = "/v1/chat/completions"
                 ) -> list:
    """Run a batch on `data` to its end; it must be `failed`, with nothing run: its errors."""
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = wait_final(client, client.batches.create(
        input_file_id=file_id, endpoint=endpoint, completion_window="24h").id)
    assert batch.status == "failed", batch
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.request_counts.completed == batch.request_counts.failed == 0
    assert batch.failed_at and batch.errors is not None
    return batch.errors.data


def test_a_file_that_is_not_jsonl_fails_the_batch_with_errors(pool) -> None:
    gateway, _ = pool
    client = gateway.openai()
    # Given an input file of CSV, not JSONL
    errors = failed_batch(client, b"custom_id,prompt\nq1,Hello\n")
    # Then the batch failed, and its errors name each line and why
    assert [(e.code, e.line) for e in errors] == [("invalid_json_line", 1),
                                                  ("invalid_json_line", 2)]
    assert "not JSON" in errors[0].message
    # And a file of valid JSON in which no line can run fails the same way, naming the field
    errors = failed_batch(client, (LINES[2] + "\n").encode())
    assert [(e.code, e.line) for e in errors] == [("invalid_request", 1)]
    assert "temperature" in errors[0].message


def test_a_line_for_another_endpoint_or_an_unknown_model_fails_the_batch(pool) -> None:
    gateway, _ = pool
    client = gateway.openai()
    # Given a chat batch whose second line is a completion
    completion = line("c", "/v1/completions", {"model": "tiny-llama.gguf", "prompt": "x",
                                                "max_tokens": 2})
    errors = failed_batch(client, f"{LINES[0]}\n{completion}\n".encode())
    # Then the batch failed on that line's url
    assert [(e.code, e.line, e.param) for e in errors] == [("invalid_url", 2, "url")]
    assert "/v1/chat/completions" in errors[0].message
    # And a line naming a model no worker serves fails it too, naming the model
    unknown = line("u", "/v1/chat/completions", {"model": "smollm2", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "x"}]})
    errors = failed_batch(client, f"{LINES[0]}\n{unknown}\n".encode())
    assert [(e.code, e.line, e.param) for e in errors] == [("model_not_found", 2, "body.model")]
    assert "`smollm2`" in errors[0].message and "tiny-llama.gguf" in errors[0].message
    # As the chat endpoint refuses it
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="smollm2", max_tokens=2,
                                       messages=[{"role": "user", "content": "x"}])
    assert refused.value.code == "model_not_found" and "smollm2" in refused.value.message


def test_a_file_that_is_too_big_or_not_for_batch_is_refused(pool, tmp_path: Path) -> None:
    gateway, _ = pool
    client = gateway.openai()
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    small = GatewayProcess(gateway.argv[gateway.argv.index("--redis-url") + 1], tmp_path,
                           extra=["--max-file-bytes", "10"]).start()
    try:
        response = httpx.post(f"{small.base_url}/v1/files", files={"file": ("x", b"x" * 50)},
                              data={"purpose": "batch"},
                              headers={"Authorization": f"Bearer {KEYS['alice']}"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "file_too_large"
    finally:
        small.stop()


NUM_KILLED_LINES = 600


def test_a_batch_survives_its_batch_worker_killed_mid_batch(pool, batch_workers) -> None:
    gateway, _ = pool
    client = gateway.openai()
    # Given a batch of 600 requests, running, some of them answered (600: on a quiet machine
    # the tiny model answers 200 before a kill at 20 lands)
    lines = [line(f"k{i}", "/v1/completions", {"model": "tiny-llama.gguf", "prompt": "x",
                                               "max_tokens": 48, "ignore_eos": True})
             for i in range(NUM_KILLED_LINES)]
    batch = client.batches.create(input_file_id=upload(client, lines),
                                  endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 20:
        assert time.monotonic() < deadline, "the batch never got going"
        time.sleep(0.05)
    # When its batch worker and the work horse running it are SIGKILLed, and another starts
    (running,) = [p for p in batch_workers.procs if p.poll() is None]
    horses = children(running.pid)
    assert horses, "the batch worker has no work horse"
    running.send_signal(signal.SIGKILL)
    for horse in horses:
        os.kill(horse, signal.SIGKILL)
    running.wait()
    assert client.batches.retrieve(batch.id).status == "in_progress"
    second = batch_workers.start()
    # Then the batch completes: every line answered, each custom_id exactly once, in order
    batch = wait_final(client, batch.id, timeout=120)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed,
            batch.request_counts.failed) == (NUM_KILLED_LINES, NUM_KILLED_LINES, 0)
    outputs = jsonl(client.files.content(batch.output_file_id).text)
    assert [o["custom_id"] for o in outputs] == [f"k{i}" for i in range(NUM_KILLED_LINES)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 48 for o in outputs)
    # And the second worker resumed from the checkpoint rather than starting over
    assert "resumes" in batch_workers.log(second)
