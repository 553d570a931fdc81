"""The dashboard's jobs in a real headless Chromium: Batch API batches and `llmq run` dataset jobs.

One tiny-model `llmq worker`, one `llmq batch-worker` and one `llmq serve` (`ops` its admin
tenant) serve the module. Two tenants each run a batch through the official SDK and the operator
runs a dataset job with `llmq run`; the page is read as a person would, signed in as each.
"""

from __future__ import annotations

import io
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmq.broker import Client
from llmq.broker.exchange import send
from llmq.broker.job_progress import JobProgress, JobRecord
from tests.e2e.cli_harness import LLMQ, llmq_process, serve, subprocess_env
from tests.e2e.gateway_harness import GatewayProcess
from tests.fixtures.browser import (
    console_errors,
    headless_chromium,
    require_chromium,
    sign_in_to_dashboard,
)
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "ops": "sk-ops"}


@pytest.fixture(scope="module")
def gateway(valkey_server, tiny_model_path: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    require_chromium()
    logs = tmp_path_factory.mktemp("dashboard-jobs")
    worker = serve(valkey_server.url, tiny_model_path, logs, "jobs-w1")
    with open(logs / "batch-worker.log", "ab") as log:
        batch_worker = llmq_process("batch-worker", env=subprocess_env(valkey_server.url),
                                    stdout=log, stderr=subprocess.STDOUT)
    gateway = GatewayProcess(valkey_server.url, logs, keys=KEYS, extra=["--admin-tenant", "ops"])
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        batch_worker.terminate()  # our own child, by PID
        batch_worker.wait(15)
        worker.stop()


@pytest.fixture(scope="module")
def browser(gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = headless_chromium(tmp_path_factory.mktemp("chromium") / "profile")
    yield driver
    driver.quit()


def run_batch(gateway: GatewayProcess, tenant: str, num_lines: int) -> str:
    """A Batch API batch of `tenant`, run to its end; its id."""
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=KEYS[tenant],
                           max_retries=0)
    lines = [{"custom_id": f"{tenant}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-llama.gguf", "max_tokens": 3,
                       "messages": [{"role": "user", "content": f"Say {i}"}]}}
             for i in range(num_lines)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 90,
             f"{tenant}'s batch to complete")
    return batch.id


@pytest.fixture(scope="module")
def jobs(gateway: GatewayProcess, valkey_server, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, str]:
    """alice's batch (3 lines), bob's (2), a finished dataset job (4 rows) and one that runs."""
    folder = tmp_path_factory.mktemp("dataset")
    (folder / "rows.jsonl").write_text("".join(json.dumps({"n": n}) + "\n" for n in range(4)))
    done = subprocess.run([*LLMQ, "run", "--dataset", str(folder / "rows.jsonl"), "-o",
                           str(folder / "out.jsonl"), "--map", "prompt=Count to {{ n }}",
                           "--map", "max_tokens=2", "--name", "count-rows"],
                          env=subprocess_env(valkey_server.url), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    batches = {"alice": run_batch(gateway, "alice", 3), "bob": run_batch(gateway, "bob", 2)}
    # NOTE: a job still running, as `llmq run` saves it between chunks (2 of 5 rows so far).
    with Client(valkey_server.url) as client:
        send(client, JobProgress(client.keys).save(JobRecord(
            id="run-still-going", name="still-going", state="running", runner="cli",
            rows_total=5, rows_done=2, started=time.time() - 90)))
    return batches


def sign_in(browser: Any, gateway: GatewayProcess, key: str) -> None:
    sign_in_to_dashboard(browser, gateway.base_url, key)


def job_rows(browser: Any) -> dict[str, dict[str, str]]:
    """The jobs table now: job id -> {column class: text}."""
    rows = browser.execute_script("""
        return [...document.querySelectorAll('#jobs tbody tr[data-job]')].map((tr) => [
          tr.dataset.job, Object.fromEntries([...tr.children].map(
            (td) => [td.className.replace('num ', ''), td.textContent]))]);""")
    return {job: cells for job, cells in rows}


def test_an_admin_sees_every_batch_and_the_dataset_jobs_with_their_progress(
        browser, gateway, jobs) -> None:
    # Given two tenants' finished batches and the operator's dataset jobs
    # When the admin tenant opens the dashboard
    sign_in(browser, gateway, KEYS["ops"])
    rows = wait_for(lambda: (r := job_rows(browser)) and len(r) >= 4 and r, 20, "the jobs table")
    # Then each batch shows as completed, all of its requests done, with its tenant
    alice, bob = rows[jobs["alice"]], rows[jobs["bob"]]
    assert (alice["kind"], alice["status"], alice["progress"].strip()) == (
        "batch", "completed", "3 / 3")
    assert (alice["completed"], alice["failed"], alice["total"]) == ("3", "0", "3")
    assert alice["job"] == f"{jobs['alice']} (alice)"
    assert (bob["status"], bob["total"], bob["job"]) == ("completed", "2", f"{jobs['bob']} (bob)")
    assert alice["created"] and alice["elapsed"].endswith("s")
    # And the dataset jobs: the finished one with its rows, the running one part way
    finished, running = rows["count-rows"], rows["still-going"]
    assert (finished["kind"], finished["status"], finished["progress"].strip()) == (
        "dataset", "completed", "4 / 4")
    assert (running["status"], running["progress"].strip(), running["total"]) == (
        "running", "2 / 5", "5")
    assert " min " in running["elapsed"]  # started 90 s before it was saved, and runs on
    assert browser.find_element("css selector", "#jobs-scope").text == \
        "(every tenant's, and dataset jobs)"
    assert console_errors(browser) == []


def test_a_tenant_sees_only_its_own_batches_and_is_told_so(browser, gateway, jobs) -> None:
    # When alice opens the dashboard
    sign_in(browser, gateway, KEYS["alice"])
    rows = wait_for(lambda: job_rows(browser), 20, "the jobs table")
    # Then her batch is there, and neither bob's nor the operator's dataset jobs
    assert list(rows) == [jobs["alice"]]
    assert rows[jobs["alice"]]["job"] == jobs["alice"]  # no tenant column for her own
    assert browser.find_element("css selector", "#jobs-scope").text == \
        "(tenant alice's batches only)"
    note = browser.find_element("css selector", "#jobs-note").text
    assert "other tenants' batches" in note and "dataset jobs" in note
