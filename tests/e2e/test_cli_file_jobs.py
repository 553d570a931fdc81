"""`llmq submit -f`: 40 requests in input order, killed halfway and resumed; and stopping a
request mid-answer (`llmq cancel`, Ctrl-C on `llmq submit`).

The worker runs the tiny model with a TEST-ONLY slow step (`LLMQ_FAULT=slow_step:<ms>`) and a
few sequences at a time, so the tests can act while requests are still running.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from llmq.broker.keys import Keys
from tests.e2e.cli_harness import llmq, llmq_process, ok, subprocess_env
from tests.integration.worker_harness import read_events, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = Keys()
QUEUE = "files"


# The module's worker (tests/e2e/conftest.py): slow steps, few seats, its own queue.
SERVE = {"worker_id": "slow-w1", "queue": QUEUE, "fault": "slow_step:40", "max_num_seqs": 4}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    # NOTE: split on "\n" only: str.splitlines also splits on U+2028, \x1c..., which the tiny
    # random model may write inside an answer (json.dumps keeps them raw with ensure_ascii=False).
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def test_forty_requests_killed_halfway_resume_without_resubmitting(url: str, r: redis.Redis,
                                                                    tmp_path: Path) -> None:
    # Given 40 requests, half of them with their own id
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"prompt": f"Request number {i}", "max_tokens": 6, "ignore_eos": True,
                    **({"id": f"own-{i}"} if i % 2 else {})}) + "\n" for i in range(40)))
    out = tmp_path / "results.jsonl"
    args = ["submit", "-f", str(requests), "-o", str(out), "--queue", QUEUE]
    stream_key = KEYS.lane_stream(QUEUE, "batch")  # file jobs are batch work (work_lanes.py)
    before = r.xlen(stream_key)

    # When the file job is killed once about a quarter of the results are written
    first = llmq_process(*args, env=subprocess_env(url), stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(_lines(out)) >= 10, 60, "10 results written")
    finally:
        first.kill()
        first.wait(10)
    written_before = _lines(out)
    assert 10 <= len(written_before) < 40
    # (everything was submitted at once, before any answer came back)
    assert r.xlen(stream_key) == before + 40
    entry_ids = [e[0] for e in r.xrange(stream_key)][-40:]

    # And the same command is run again
    result = ok(llmq(*args, url=url))

    # Then all 40 results are there, in input order, the first ones exactly as written before
    records = _lines(out)
    assert [rec["line"] for rec in records] == list(range(1, 41))
    assert all(rec["finish_reason"] == "length" for rec in records)
    assert [rec["id"] for rec in records[1::2]] == [f"own-{i}" for i in range(1, 40, 2)]
    assert records[:len(written_before)] == written_before
    # And nothing was submitted a second time: the request stream has the same 40 entries
    assert r.xlen(stream_key) == before + 40
    assert [e[0] for e in r.xrange(stream_key)][-40:] == entry_ids
    assert f"({len(written_before)} already done)" in result.stderr
    assert "40 requests: 40 ok, 0 failed" in result.stderr

    # And a third run finds everything done
    again = ok(llmq(*args, url=url))
    assert "(40 already done)" in again.stderr and _lines(out) == records
    assert r.xlen(stream_key) == before + 40


def test_a_progress_bar_reports_done_tokens_and_eta(url: str, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 4}) + "\n"
                                for i in range(4)))
    result = ok(llmq("submit", "-f", str(requests), "--progress", "--queue", QUEUE, url=url))
    # stdout (no -o) gets the results; stderr the bar and the summary
    assert len(result.stdout.splitlines()) == 4
    assert "4/4" in result.stderr and "100%" in result.stderr and "tok/s" in result.stderr


def test_cancel_stops_a_running_request(url: str, r: redis.Redis) -> None:
    # Given a long request that has started
    ok(llmq("submit", "Go on", "--no-wait", "--id", "t-long", "--max-tokens", "200",
            "--ignore-eos", "--queue", QUEUE, url=url))
    wait_for(lambda: read_events(r, "t-long"), 30, "the request to start")
    # When it is cancelled
    assert ok(llmq("cancel", "t-long", "--queue", QUEUE, url=url)).stdout \
        == "cancel requested for t-long\n"
    # Then it ends early with finish_reason cancelled, and `result` says so
    followed = ok(llmq("result", "t-long", "--follow", "--timeout", "30", url=url))
    assert "request t-long was cancelled" in followed.stderr
    done = json.loads(ok(llmq("result", "t-long", "--json", url=url)).stdout.splitlines()[-1])
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 200


def test_ctrl_c_on_submit_cancels_the_request(url: str, r: redis.Redis) -> None:
    # Given a person watching a long answer stream
    proc = llmq_process("submit", "Go on", "--id", "t-ctrl-c", "--max-tokens", "200",
                        "--ignore-eos", "--queue", QUEUE, env=subprocess_env(url),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(read_events(r, "t-ctrl-c")) > 3, 30, "some tokens")
        # When they press Ctrl-C
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Then the command exits 130 saying so, and the request is stopped, not left running
    assert proc.returncode == 130, stderr
    assert "cancelled request t-ctrl-c" in stderr
    wait_for(lambda: any(getattr(e, "finish_reason", None) == "cancelled"
                         for e in read_events(r, "t-ctrl-c")), 30, "the cancelled done event")
