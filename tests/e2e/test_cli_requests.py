"""`llmq submit / result / cancel / status / dlq / bench` against a real server and worker.

One valkey-server and one `llmq worker` on the tiny model serve the whole module; each test uses
its own request ids, so nothing is flushed between tests.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from llmq.broker.keys import Keys
from llmq.protocol import (
    DeadLetter,
    Delta,
    Done,
    Start,
    Timings,
    Usage,
    encode_dead_letter,
    encode_event,
)
from tests.e2e.cli_harness import llmq, ok, one_error_line, printed

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = Keys()


SERVE = {"worker_id": "cli-w1"}  # the module's worker (tests/e2e/conftest.py)


def done_event(url: str, request_id: str) -> dict:
    lines = ok(llmq("result", request_id, "--json", url=url)).stdout.splitlines()
    return json.loads(lines[-1])


# -- submit ---------------------------------------------------------------------------------------


def test_a_prompt_streams_its_answer_to_stdout(url: str) -> None:
    # When a person submits one prompt
    result = ok(llmq("submit", "Hello there", "--id", "t-stream", "--max-tokens", "12",
                     "--ignore-eos", "--temperature", "0", url=url))
    # Then stdout is exactly the answer (plus a newline), as its done event has it
    done = done_event(url, "t-stream")
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert printed(result) == done["text"] + "\n"
    assert done["usage"]["completion_tokens"] == 12
    assert result.stderr == ""  # a worker serves the queue: nothing to warn about


@pytest.mark.parametrize("how", ["chat", "messages", "stdin", "no-stream"])
def test_chat_messages_stdin_and_no_stream_each_get_an_answer(url: str, how: str) -> None:
    request_id = f"t-{how}"
    args = {"chat": ["--chat", "Hi!"],
            "messages": ["--messages", '[{"role": "system", "content": "Be brief."}, '
                                       '{"role": "user", "content": "Hi"}]'],
            "stdin": ["-"],
            "no-stream": ["Tell me", "--no-stream"]}[how]
    result = ok(llmq("submit", *args, "--id", request_id, "--max-tokens", "6", "--ignore-eos",
                     url=url, input="A prompt from stdin" if how == "stdin" else None))
    assert printed(result) == done_event(url, request_id)["text"] + "\n"


def test_json_prints_one_event_per_line(url: str) -> None:
    result = ok(llmq("submit", "Hi", "--json", "--max-tokens", "4", "--ignore-eos", url=url))
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["type"] for e in events] == ["start", "delta", "delta", "delta", "delta", "done"]
    assert "".join(e["text"] for e in events if e["type"] == "delta") == events[-1]["text"]


def test_no_wait_prints_the_id_and_result_follow_gets_the_answer(url: str) -> None:
    request_id = ok(llmq("submit", "Hi", "--no-wait", "--id", "t-later", "--max-tokens", "5",
                         url=url)).stdout.strip()
    assert request_id == "t-later"
    followed = ok(llmq("result", "t-later", "--follow", "--timeout", "30", url=url))
    assert printed(followed) == done_event(url, "t-later")["text"] + "\n"
    # And without --follow a finished request shows the same answer
    assert printed(ok(llmq("result", "t-later", url=url))) == printed(followed)


@pytest.mark.parametrize("args, exit_code, names", [
    (["submit", "Hi", "--max-tokens", "0"], 2, "--max-tokens"),
    (["submit", "Hi", "--temperature", "5"], 1, "temperature"),
    (["submit", "Hi", "--top-p", "1.5"], 2, "--top-p"),
    (["submit", "--messages", "not json"], 2, "--messages"),
    (["submit", "--messages", '[{"role": "robot", "content": "x"}]'], 1, "role"),
    (["submit"], 2, "exactly one of"),
    (["submit", "Hi", "--chat", "Hi"], 2, "exactly one of"),
    (["submit", "Hi", "--id", "has space"], 1, "request_id"),
    (["submit", "Hi", "--queue", "no/slash"], 1, "queue"),
    (["submit", "-"], 2, "stdin was empty"),
])
def test_bad_values_are_refused_before_anything_is_sent(url: str, r: redis.Redis,
                                                         args: list[str], exit_code: int,
                                                         names: str) -> None:
    before = r.xlen(KEYS.queue("default"))
    result = llmq(*args, url=url, input="")
    assert result.exit_code == exit_code, result.output
    assert names in result.stderr and "Traceback" not in result.output
    assert r.xlen(KEYS.queue("default")) == before


def test_a_request_the_worker_refuses_is_one_error_line(url: str) -> None:
    # The module's worker runs with max_model_len 256: this prompt cannot fit
    line = one_error_line(llmq("submit", "word " * 400, "--id", "t-too-long", url=url))
    assert line.startswith("Error: request t-too-long failed: prompt_too_long")


def test_a_timeout_says_how_to_pick_the_request_up_again(url: str) -> None:
    result = llmq("submit", "Hi", "--id", "t-timeout", "--queue", "idle", "--timeout", "0.3",
                  url=url)
    assert result.exit_code == 1 and "Traceback" not in result.output
    warning, line = result.stderr.splitlines()
    assert "no worker is serving queue 'idle'" in warning
    assert "no result for request t-timeout within 0.3s" in line
    assert "llmq result t-timeout --follow" in line


# -- result and cancel ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["result", "cancel"])
def test_an_unknown_request_id_is_one_clear_line(url: str, command: str) -> None:
    line = one_error_line(llmq(command, "no-such-request", url=url))
    assert "unknown request no-such-request" in line


def test_result_drops_the_text_of_a_superseded_attempt(url: str, r: redis.Redis) -> None:
    # Given a request whose first worker died mid-answer and a peer re-ran it (attempt 2)
    key = KEYS.result("t-restart")
    timings = Timings(queue=0.0, ttft=0.1, e2e=0.2, per_token=0.01)
    for event in [Start(request_id="t-restart", attempt=1, worker="a", prompt_tokens=3),
                  Delta(request_id="t-restart", attempt=1, seq=0, text="half an ans",
                        token_ids=[1]),
                  Start(request_id="t-restart", attempt=2, worker="b", prompt_tokens=3),
                  Delta(request_id="t-restart", attempt=2, seq=0, text="The whole ",
                        token_ids=[2]),
                  Delta(request_id="t-restart", attempt=1, seq=1, text="LATE", token_ids=[3]),
                  Delta(request_id="t-restart", attempt=2, seq=1, text="answer.",
                        token_ids=[4]),
                  Done(request_id="t-restart", attempt=2, finish_reason="stop",
                       text="The whole answer.", usage=Usage(3, 2), timings=timings)]:
        r.xadd(key, encode_event(event))
    # When its result is shown
    result = ok(llmq("result", "t-restart", url=url))
    # Then the terminal shows the partial text, a note, and the whole new answer; the late
    # delta of the dead attempt never appears
    assert result.stdout == "half an ans\nThe whole answer.\n"
    assert "attempt 2 started on worker b" in result.stderr and "superseded" in result.stderr
    # And --json shows exactly the events of the attempts a reader keeps
    events = [json.loads(line) for line in ok(llmq("result", "t-restart", "--json",
                                                   url=url)).stdout.splitlines()]
    assert "LATE" not in [e.get("text") for e in events]
    assert events[-1]["text"] == "The whole answer."


def test_cancel_of_a_queued_request_means_it_never_runs(url: str, r: redis.Redis) -> None:
    # Given a request waiting in a queue no worker serves
    ok(llmq("submit", "Hi", "--no-wait", "--id", "t-cancel", "--queue", "idle", url=url))
    assert "queued, not started yet" in ok(llmq("result", "t-cancel", "--queue", "idle",
                                                url=url)).stderr
    # When it is cancelled
    result = ok(llmq("cancel", "t-cancel", "--queue", "idle", url=url))
    # Then the workers are told, and the flag is there for whichever worker admits it
    assert result.stdout == "cancel requested for t-cancel\n"
    assert r.exists(KEYS.cancel_flag("t-cancel"))
    assert r.xlen(KEYS.cancel("idle")) == 1


def test_cancel_of_a_finished_request_says_so(url: str) -> None:
    ok(llmq("submit", "Hi", "--id", "t-finished", "--max-tokens", "2", url=url))
    result = ok(llmq("cancel", "t-finished", url=url))
    assert "already finished" in result.stderr


# -- status and dead letters ----------------------------------------------------------------------


def test_status_shows_queues_and_live_workers(url: str) -> None:
    table = ok(llmq("status", url=url)).stdout
    assert "QUEUE" in table and "LAG" in table and "DEAD LETTERS" in table
    assert "cli-w1" in table and "tiny-llama.gguf" in table
    status = json.loads(ok(llmq("status", "--json", url=url)).stdout)
    default = next(q for q in status["queues"] if q["queue"] == "default")
    assert default["lag"] == 0 and default["consumers"] >= 1
    (worker,) = [w for w in status["workers"] if w["worker_id"] == "cli-w1"]
    assert worker["queue"] == "default" and worker["model"] == "tiny-llama.gguf"
    assert {"running", "waiting", "kv_usage", "tokens_per_s", "heartbeat_age_s"} <= set(worker)


def test_dead_letters_are_listed_retried_and_purged(url: str, r: redis.Redis) -> None:
    queue_key, dlq_key = KEYS.queue("default"), KEYS.dlq("default")
    # Given an entry no worker can decode (it is dead-lettered) ...
    r.xadd(queue_key, {"foo": "bar"})
    # ... and a poison request that kept killing workers, with its payload kept
    payload = {"json": json.dumps({"id": "t-poison", "prompt": "Hi", "max_tokens": 3})}
    poison = DeadLetter(queue="default", entry_id="1-0", request_id="t-poison", code="poison",
                        message="delivered 3 times", deliveries=3)
    poison_entry = r.xadd(dlq_key, encode_dead_letter(poison, payload)).decode()
    deadline = time.monotonic() + 30
    while r.xlen(dlq_key) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    # When they are listed
    listing = ok(llmq("dlq", "list", url=url)).stdout
    assert "t-poison" in listing and "poison" in listing and "invalid_request" in listing
    as_json = [json.loads(line) for line in ok(llmq("dlq", "list", "--json", url=url)).stdout
               .splitlines()]
    assert {e["code"] for e in as_json} == {"poison", "invalid_request"}
    # And the poison one is retried: it runs again, under its own id
    retried = ok(llmq("dlq", "retry", poison_entry, url=url)).stdout
    assert retried.startswith(f"requeued {poison_entry} as ")
    assert done_event_follow(url, "t-poison")["finish_reason"] == "length"
    # And an unknown entry is one clear line
    assert "no dead letter 9-9" in one_error_line(llmq("dlq", "retry", "9-9", url=url))
    # When the rest are purged
    assert ok(llmq("dlq", "purge", "--yes", url=url)).stdout.startswith("purged 1 dead letter")
    assert r.xlen(dlq_key) == 0
    assert "no dead letters" in ok(llmq("dlq", "list", url=url)).stdout


def done_event_follow(url: str, request_id: str) -> dict:
    lines = ok(llmq("result", request_id, "--follow", "--json", "--timeout", "30",
                    url=url)).stdout.splitlines()
    return json.loads(lines[-1])


# -- a small file, and bench ----------------------------------------------------------------------


def test_a_file_with_a_malformed_line_still_answers_the_rest(url: str, tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join([
        json.dumps({"prompt": "one", "max_tokens": 3}),
        "{this is not json",
        json.dumps({"prompt": "three", "temperature": 9}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "five"}], "max_tokens": 3,
                    "metadata": {"row": 5}}),
    ]) + "\n")
    out = tmp_path / "results.jsonl"
    result = ok(llmq("submit", "-f", str(requests), "-o", str(out), url=url))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [rec["line"] for rec in records] == [1, 2, 3, 5]
    assert records[0]["finish_reason"] == "length" and records[3]["metadata"] == {"row": 5}
    assert records[1]["error"]["code"] == "invalid_request"
    assert records[1]["error"]["message"].startswith("line 2: not JSON")
    assert "line 3:" in records[2]["error"]["message"]
    assert "temperature" in records[2]["error"]["message"]
    assert "4 requests: 2 ok, 2 failed" in result.stderr


def test_bench_prints_throughput_and_latency_percentiles(url: str) -> None:
    result = ok(llmq("bench", "-n", "6", "-c", "3", "--prompt-len", "8", "--output-len", "5",
                     url=url))
    assert "6 ok, 0 failed" in result.stdout
    for label in ("throughput", "TTFT ms", "ITL ms", "E2E ms", "p50", "p99"):
        assert label in result.stdout
    figures = json.loads(ok(llmq("bench", "-n", "4", "-c", "2", "--prompt-len", "8",
                                 "--output-len", "5", "--json", url=url)).stdout)
    assert figures["completed"] == 4 and figures["output_tokens"] == 20
    assert figures["ttft_ms"]["p50"] > 0 and figures["itl_ms"]["p90"] > 0


def test_bench_refuses_a_queue_nobody_serves(url: str) -> None:
    line = one_error_line(llmq("bench", "-n", "1", "--queue", "idle", url=url))
    assert "no worker is serving queue 'idle'" in line


def test_a_redis_acl_user_in_the_url(url: str, r: redis.Redis) -> None:
    # Given an ACL user allowed only llmq's keys and the commands the CLI needs
    r.execute_command("ACL", "SETUSER", "cli-user", "on", ">cli-pass", "~llmq:*", "&*",
                      "+@all", "-@dangerous")
    port = url.rsplit(":", 1)[1].split("/")[0]
    user_url = f"redis://cli-user:cli-pass@127.0.0.1:{port}/0"
    try:
        # When a command connects with --redis-url (the flag, not the variable)
        result = ok(llmq("submit", "Hi", "--max-tokens", "3", "--redis-url", user_url))
        assert result.stdout.strip()
        # Then a wrong password is one line, naming the fix and never the password
        wrong = f"redis://cli-user:nope@127.0.0.1:{port}/0"
        line = one_error_line(llmq("status", "--redis-url", wrong))
        assert "refused the credentials" in line and "nope" not in line
    finally:
        r.execute_command("ACL", "DELUSER", "cli-user")
