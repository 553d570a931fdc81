"""`llmq batch` on rq: an OpenAI batch file in, OpenAI batch output and error files out.

One valkey-server and one tiny-model `llmq worker` serve the module; batch jobs run on
`llmq batch-worker --burst` (in-process, or as a child process when the test acts meanwhile).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

from llmq.broker.keys import Keys
from tests.e2e.cli_harness import llmq, llmq_process, ok, one_error_line, subprocess_env
from tests.integration.worker_harness import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = Keys()


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


MODEL = "tiny-llama.gguf"  # what the tiny model's worker serves (a batch line must name it)
MIXED = [
    line("chat-1", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
          "temperature": 0}),
    line("cmpl-1", "/v1/completions",
         {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}),
    line("bad-url", "/v1/embeddings", {"model": MODEL, "input": "Hi"}),
    line("chat-2", "/v1/chat/completions",
         {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Why?"}],
          "max_completion_tokens": 3, "ignore_eos": True}),
    line("bad-temp", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 7}),
]


SERVE = {"worker_id": "batch-w1"}  # the module's worker (tests/e2e/conftest.py)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _status(url: str, batch_id: str) -> dict:
    return json.loads(ok(llmq("batch", "status", batch_id, "--json", url=url)).stdout)


def test_a_mixed_batch_gives_answers_and_an_error_file(url: str, tmp_path: Path) -> None:
    # Given an OpenAI batch file with chat and completion lines and two invalid lines
    batch_file = _write(tmp_path / "batch.jsonl", MIXED)
    submitted = ok(llmq("batch", "submit", str(batch_file), url=url))
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_") and "no batch worker is running" in submitted.stderr
    assert _status(url, batch_id)["status"] == "queued"

    # When a batch worker runs it
    ok(llmq("batch-worker", "--burst", url=url))

    # Then the rq job has finished, with the OpenAI-style counts in its meta
    status = _status(url, batch_id)
    assert status["rq_status"] == "finished" and status["status"] == "completed"
    assert status["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert "3 completed, 2 failed, 5 total" in ok(llmq("batch", "status", batch_id,
                                                       url=url)).stdout
    # And the output file has the three answers, in input order, shaped like OpenAI's
    out = tmp_path / "out.jsonl"
    result = ok(llmq("batch", "results", batch_id, "-o", str(out), url=url))
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [rec["custom_id"] for rec in records] == ["chat-1", "cmpl-1", "chat-2"]
    chat, completion, chat2 = (rec["response"] for rec in records)
    assert all(rec["error"] is None and rec["id"].startswith("batch_req_") for rec in records)
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["role"] == "assistant"
    assert chat["body"]["model"] == "tiny-llama.gguf"
    assert completion["body"]["object"] == "text_completion"
    assert completion["body"]["choices"][0]["finish_reason"] == "length"
    assert completion["body"]["usage"]["completion_tokens"] == 4
    assert chat2["body"]["usage"]["completion_tokens"] == 3
    usage = completion["body"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # And the error file has the two invalid lines with their reasons
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [("bad-url", 3),
                                                                      ("bad-temp", 5)]
    assert all(e["response"] is None for e in errors)
    assert "/v1/embeddings" in errors[0]["error"]["message"]
    assert "temperature" in errors[1]["error"]["message"]
    assert "3 result line(s)" in result.stderr and "2 error line(s)" in result.stderr
    # And the batch is listed
    assert batch_id in ok(llmq("batch", "list", url=url)).stdout


def test_a_file_that_is_not_jsonl_or_names_an_unserved_model_fails(url: str,
                                                                     tmp_path: Path) -> None:
    # Given a CSV file, and a JSONL file one of whose lines names a model no worker serves
    csv = ok(llmq("batch", "submit", str(_write(tmp_path / "in.csv", ["id,prompt", "q1,Hi"])),
                  url=url)).stdout.strip()
    unserved = line("u", "/v1/completions", {"model": "smollm2", "prompt": "x"})
    wrong = ok(llmq("batch", "submit", str(_write(tmp_path / "in.jsonl", [MIXED[1], unserved])),
                    url=url)).stdout.strip()
    # When a batch worker runs them
    ok(llmq("batch-worker", "--burst", url=url))
    # Then both failed with nothing run, and their status says which line and why
    status = _status(url, csv)
    assert status["status"] == "failed" and status["request_counts"]["completed"] == 0
    assert [(e["code"], e["line"]) for e in status["errors"]] == [("invalid_json_line", 1),
                                                                  ("invalid_json_line", 2)]
    shown = ok(llmq("batch", "status", wrong, url=url)).stdout
    assert "failed" in shown and "line 2: the model `smollm2` does not exist" in shown


def test_cancel_stops_the_fan_out_and_cancels_submitted_requests(url: str, r: redis.Redis,
                                                                  tmp_path: Path) -> None:
    # Given a 20-line batch on a queue no worker serves, fanned out 2 at a time
    lines = [line(f"c{i}", "/v1/completions", {"prompt": f"p{i}", "max_tokens": 4})
             for i in range(20)]
    batch_file = _write(tmp_path / "batch.jsonl", lines)
    batch_id = ok(llmq("batch", "submit", str(batch_file), "--queue", "idle",
                       "--max-in-flight", "2", url=url)).stdout.strip()
    worker = llmq_process("batch-worker", "--burst", env=subprocess_env(url),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _status(url, batch_id)["status"] == "in_progress"
                 and r.xlen(KEYS.lane_stream("idle", "batch")) == 2, 30, "the first two requests")
        # When the batch is cancelled
        result = ok(llmq("batch", "cancel", batch_id, "--wait", url=url))
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    # Then the fan-out stopped: only the first two requests were ever queued, and both were
    # cancelled for the workers
    assert "cancelling batch" in result.stdout
    assert r.xlen(KEYS.lane_stream("idle", "batch")) == 2
    assert all(r.exists(KEYS.cancel_flag(f"{batch_id}.{n}")) for n in (1, 2))
    # And the job finished, reporting the batch cancelled, every line accounted for
    status = _status(url, batch_id)
    assert status["status"] == "cancelled" and status["rq_status"] == "finished"
    out = tmp_path / "out.jsonl"
    ok(llmq("batch", "results", batch_id, "-o", str(out), url=url))
    assert out.read_text() == ""
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert len(errors) == 20 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_cancel_of_a_queued_batch_means_it_never_runs(url: str, tmp_path: Path) -> None:
    batch_file = _write(tmp_path / "batch.jsonl", MIXED[:1])
    batch_id = ok(llmq("batch", "submit", str(batch_file), url=url)).stdout.strip()
    assert "it had not started" in ok(llmq("batch", "cancel", batch_id, url=url)).stdout
    status = _status(url, batch_id)
    assert status["status"] == "cancelled" and status["rq_status"] == "canceled"
    ok(llmq("batch-worker", "--burst", url=url))  # nothing left to run
    assert _status(url, batch_id)["request_counts"]["completed"] == 0
    assert "already cancelled" in ok(llmq("batch", "cancel", batch_id, url=url)).stderr


def test_results_of_an_unfinished_or_unknown_batch_are_one_line(url: str,
                                                               tmp_path: Path) -> None:
    batch_file = _write(tmp_path / "batch.jsonl", MIXED[:1])
    batch_id = ok(llmq("batch", "submit", str(batch_file), url=url)).stdout.strip()
    line_ = one_error_line(llmq("batch", "results", batch_id, url=url))
    assert "is queued (0/1 done)" in line_ and "--wait" in line_
    ok(llmq("batch-worker", "--burst", url=url))
    waited = ok(llmq("batch", "results", batch_id, "--wait", "--timeout", "30", url=url))
    assert json.loads(waited.stdout)["custom_id"] == "chat-1"
    for command in (["status"], ["results"], ["cancel"]):
        assert "unknown batch batch_nope" in one_error_line(
            llmq("batch", *command, "batch_nope", url=url))


def test_a_file_that_is_not_there_or_empty_is_refused(url: str, tmp_path: Path) -> None:
    assert llmq("batch", "submit", str(tmp_path / "missing.jsonl"), url=url).exit_code == 2
    empty = _write(tmp_path / "empty.jsonl", [""])
    result = llmq("batch", "submit", str(empty), url=url)
    assert result.exit_code == 2 and "no lines" in result.stderr
