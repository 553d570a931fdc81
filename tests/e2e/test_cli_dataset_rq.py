"""`llmq run --rq`: dataset jobs as rq jobs on `llmq batch-worker`, followed with `llmq run status`.

One valkey-server and one slowed tiny-model worker (few seats) serve the module, so a batch
worker SIGKILLed mid-job leaves rows unwritten and requests in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis

from llmq.broker.client import Client
from llmq.broker.embedded import free_port
from llmq.broker.keys import Keys
from tests.e2e.cli_harness import llmq, llmq_process, ok, one_error_line, subprocess_env
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = Keys()
SERVE = {"worker_id": "ds-rq-w1", "fault": "slow_step:30", "max_num_seqs": 4}


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def _status(url: str, job_id: str) -> dict:
    return json.loads(ok(llmq("run", "status", job_id, "--json", url=url)).stdout)


def _dataset(path: Path, rows: int, missing: int | None = None) -> Path:
    path.write_text("".join(json.dumps({"n": i} if i != missing else {"other": i}) + "\n"
                            for i in range(rows)))
    return path


def test_a_dataset_job_queued_on_rq_runs_on_a_batch_worker(url: str, tmp_path: Path) -> None:
    # Given a dataset of 12 rows, one missing the templated column
    source = _dataset(tmp_path / "in.jsonl", 12, missing=5)
    args = ["run", "--dataset", str(source), "-o", str(tmp_path / "out.parquet"),
            "--map", "prompt=Count to {{ n }}", "--map", "max_tokens=3",
            "--map", "ignore_eos=true", "--name", "rq-basic", "--rq"]

    # When it is queued on rq
    submitted = ok(llmq(*args, url=url))

    # Then the CLI prints the job id, says no batch worker runs, and the job shows as queued
    assert submitted.stdout.strip() == "run-rq-basic"
    assert "no batch worker is running" in submitted.stderr
    assert _status(url, "run-rq-basic")["state"] == "queued"
    # And queuing it again, or running it in the CLI, while it waits is refused in one line
    assert "already queued" in one_error_line(llmq(*args, url=url))
    assert "already queued on rq" in one_error_line(llmq(*args[:-1], url=url))

    # When a batch worker runs it
    ok(llmq("batch-worker", "--burst", url=url))

    # Then the output has the 11 good rows in input order, the errors file the bad one
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [row["n"] for row in rows] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert all(row["result_usage"]["completion_tokens"] == 3 for row in rows)
    (error,) = _jsonl(tmp_path / "out.errors.jsonl")
    assert error["llmq_row"] == 5 and "n" in error["error"]["message"]
    # And `llmq run status` shows the job completed, with its counts
    status = _status(url, "rq-basic")  # the name works as well as the id
    assert (status["state"], status["runner"], status["rq_status"]) == ("completed", "rq",
                                                                         "finished")
    assert (status["rows_done"], status["rows_total"], status["rows_failed"]) == (12, 12, 1)
    assert status["stages"][0]["done"] == 11 and status["stages"][0]["tokens"] == 33
    text = ok(llmq("run", "status", "run-rq-basic", url=url)).stdout
    assert "completed (rq: finished)" in text and "12/12 done, 1 to the errors file" in text
    # And `llmq run list` and `llmq batch list` show it
    assert "run-rq-basic" in ok(llmq("run", "list", url=url)).stdout
    assert "run-rq-basic" in ok(llmq("batch", "list", url=url)).stdout


def test_a_job_run_in_the_cli_is_in_the_job_store_too(url: str, tmp_path: Path) -> None:
    # Given a dataset job run in the foreground
    source = _dataset(tmp_path / "in.jsonl", 4)
    ok(llmq("run", "--dataset", str(source), "-o", str(tmp_path / "out.jsonl"),
            "--map", "prompt=Hi {{ n }}", "--map", "max_tokens=2", "--name", "rq-local",
            url=url))
    # Then `llmq run status` reads it: completed by the CLI, its summary as the message
    status = _status(url, "run-rq-local")
    assert (status["state"], status["runner"], status["rq_status"]) == ("completed", "cli",
                                                                        None)
    assert status["rows_done"] == 4 and "4 rows -> " in status["message"]
    # And an unknown job is one clear line
    assert "unknown dataset job" in one_error_line(llmq("run", "status", "nope", url=url))


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (an rq worker's work horse)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def test_a_killed_batch_workers_job_resumes_on_another(url: str, r: redis.Redis,
                                                       tmp_path: Path) -> None:
    # Given a 60-row job on rq, a few requests in flight at a time, running on a batch worker
    source = _dataset(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out.jsonl"
    ok(llmq("run", "--dataset", str(source), "-o", str(out), "--map", "prompt=Count {{ n }}",
            "--map", "max_tokens=8", "--map", "ignore_eos=true", "--max-in-flight", "8",
            "--name", "rq-killed", "--rq", url=url))
    env = subprocess_env(url)
    first = llmq_process("batch-worker", env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    second = None
    try:
        wait_for(lambda: len(_jsonl(out)) >= 5, 90, "5 rows written by the first worker")
        # When the batch worker and its work horse are SIGKILLed mid-job
        horses = _children(first.pid)
        assert horses, "the batch worker has no work horse"
        first.send_signal(signal.SIGKILL)
        for horse in horses:
            os.kill(horse, signal.SIGKILL)
        first.wait(10)
        written = len(_jsonl(out))
        assert written < 60
        # And another batch worker starts
        second = llmq_process("batch-worker", env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        # Then the job is retried there and completes
        wait_for(lambda: _status(url, "run-rq-killed")["state"] == "completed", 180,
                 "the job completed on the second batch worker")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()  # our own children, by PID
                proc.wait(20)

    # And every row is in the output once, in input order, each a whole answer
    rows = _jsonl(out)
    assert [row["llmq_row"] for row in rows] == list(range(60))
    assert all(row["result_usage"]["completion_tokens"] == 8 for row in rows)
    assert not _jsonl(tmp_path / "out.errors.jsonl")
    # And the retry resumed from the rows written, not from row 0
    assert "rows done by an earlier run" in _status(url, "run-rq-killed")["message"]
    # And no request was queued twice (among the entries the stream still holds: acked ones are
    # trimmed), each row's text the answer the pool stored for its request id
    queued = Counter(json.loads(fields[b"json"])["id"]
                     for _, fields in r.xrange(KEYS.queue("default"))
                     if json.loads(fields[b"json"]).get("id", "").startswith("rq-killed."))
    assert max(queued.values(), default=1) == 1
    with Client(url) as client:
        assert all(client.result(row["result_id"], timeout=30).text == row["result"]
                   for row in rows)


def test_cancel_stops_a_job_and_queuing_it_again_resumes(url: str, tmp_path: Path) -> None:
    source = _dataset(tmp_path / "in.jsonl", 60)
    out = tmp_path / "out.jsonl"
    args = ["run", "--dataset", str(source), "-o", str(out), "--map", "prompt=Say {{ n }}",
            "--map", "max_tokens=8", "--map", "ignore_eos=true", "--max-in-flight", "8",
            "--name", "rq-cancel", "--rq"]
    # Given a job queued on rq, no batch worker running yet
    ok(llmq(*args, url=url))
    # When it is cancelled before it starts, then a batch worker looks for work
    assert "was not running" in ok(llmq("run", "cancel", "run-rq-cancel", url=url)).stdout
    ok(llmq("batch-worker", "--burst", url=url))
    # Then it never ran
    assert _status(url, "run-rq-cancel")["state"] == "cancelled" and not out.exists()

    # Given it queued again, running on a batch worker
    ok(llmq(*args, url=url))
    worker = llmq_process("batch-worker", env=subprocess_env(url), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(_jsonl(out)) >= 5, 90, "5 rows written")
        # When it is cancelled while it runs
        assert "stopping run-rq-cancel" in ok(llmq("run", "cancel", "rq-cancel",
                                                   url=url)).stdout
        # Then it stops, cancelled, with part of the rows written
        wait_for(lambda: _status(url, "run-rq-cancel")["state"] == "cancelled", 60,
                 "the job stopped")
        assert 5 <= len(_jsonl(out)) < 60
        # When it is queued once more
        ok(llmq(*args, url=url))
        # Then it completes, every row once and in order, resumed from the rows written
        wait_for(lambda: _status(url, "run-rq-cancel")["state"] == "completed", 120,
                 "the job completed")
    finally:
        worker.terminate()  # our own child, by PID
        try:
            worker.wait(60)  # rq's warm shutdown lets a job in hand finish first
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    assert [row["llmq_row"] for row in _jsonl(out)] == list(range(60))
    assert "rows done by an earlier run" in _status(url, "run-rq-cancel")["message"]


def test_a_job_whose_dataset_is_gone_fails_at_once_saying_why(url: str, tmp_path: Path) -> None:
    # Given a job queued on rq, its dataset removed before a batch worker runs it
    source = _dataset(tmp_path / "gone.jsonl", 3)
    ok(llmq("run", "--dataset", str(source), "-o", str(tmp_path / "out.jsonl"),
            "--map", "prompt={{ n }}", "--name", "rq-gone", "--rq", url=url))
    source.unlink()
    # When a batch worker runs it
    ok(llmq("batch-worker", "--burst", url=url))
    # Then it failed, not retried, and says what was missing
    status = _status(url, "run-rq-gone")
    assert status["state"] == "failed" and "gone.jsonl" in status["message"], status
    assert "failed" in ok(llmq("run", "status", "run-rq-gone", url=url)).stdout


@pytest.mark.parametrize("command", [["run", "status", "x"], ["run", "list"],
                                     ["run", "cancel", "x"], ["run", "{data}", "--rq"]],
                         ids=" ".join)
def test_with_no_server_each_command_says_so_in_one_line(command: list[str],
                                                         tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text('{"source": "in.jsonl", "output": "out.jsonl", "stages": [{"prompt": "x"}]}')
    url = f"redis://127.0.0.1:{free_port()}/0"
    line = one_error_line(llmq(*[a.format(data=job) for a in command], url=url))
    assert f"no Redis server at {url}" in line
