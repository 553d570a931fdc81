"""Bad inputs never hurt the worker (docs/reliability.md, scenarios 16-22, invariant I5):
each gets its error, then the
same worker process (same PID) serves a good request.

One `llmq worker` process (on valkey: tests/fixtures/redis_servers.py) serves the whole table.
Every test flushes the server
under it, so the worker also recovers from its consumer group vanishing each time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from llmq import protocol
from tests.integration.worker_harness import (
    KEYS,
    MAX_MODEL_LEN,
    QUEUE_KEY,
    WorkerProcess,
    dead_letters,
    num_pending,
    read_events,
    terminal_events,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.redis

DEEP = 100_000
# name -> (entry fields, request id if the payload names one, expected code, text in message)
CASES: dict[str, tuple[dict[str, Any], str | None, str, str]] = {
    "malformed json": ({"json": '{"prompt": "Hi", '}, None, "invalid_request", "malformed"),
    "malformed msgpack": ({"msgpack": b"\x85\xa6prompt"}, None, "invalid_request", "malformed"),
    "invalid utf-8": ({"json": b'{"prompt": "\xff\xfe"}'}, None, "invalid_request", ""),
    "not an object": ({"json": "[1, 2, 3]"}, None, "invalid_request", ""),
    "wrong field name": ({"payload": '{"prompt": "Hi"}'}, None, "invalid_request", "json"),
    "two fields": ({"json": "{}", "msgpack": b"\x80"}, None, "invalid_request", "exactly one"),
    "unknown field": ({"json": '{"prompt": "Hi", "bogus": 1}'}, None, "invalid_request", "bogus"),
    "wrong type": ({"json": '{"prompt": 5}'}, None, "invalid_request", "$.prompt"),
    "no prompt": ({"json": '{"max_tokens": 5}'}, None, "invalid_request", "prompt"),
    "prompt and messages": (
        {"json": json.dumps({"prompt": "Hi", "messages": [{"role": "user", "content": "x"}]})},
        None, "invalid_request", "exactly one"),
    "bad chat role": ({"json": '{"messages": [{"role": "wizard", "content": "x"}]}'}, None,
                      "invalid_request", "role"),
    "negative max_tokens": ({"json": '{"prompt": "Hi", "max_tokens": -1}'}, None,
                            "invalid_request", "$.max_tokens"),
    "huge max_tokens": ({"json": '{"prompt": "Hi", "max_tokens": 1000000000}'}, None,
                        "invalid_request", "$.max_tokens"),
    "min_tokens over max_tokens": ({"json": '{"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}'},
                                   None, "invalid_request", "min_tokens"),
    "negative temperature": ({"json": '{"prompt": "Hi", "temperature": -1}'}, None,
                             "invalid_request", "$.temperature"),
    "huge temperature": ({"json": '{"prompt": "Hi", "temperature": 1e308}'}, None,
                         "invalid_request", "$.temperature"),
    "zero top_p": ({"json": '{"prompt": "Hi", "top_p": 0}'}, None, "invalid_request", "$.top_p"),
    "too many stop strings": ({"json": json.dumps({"prompt": "Hi", "stop": ["x"] * 10_000})},
                              None, "invalid_request", "$.stop"),
    "prompt ids over the context": (
        {"json": json.dumps({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)})}, None,
        "prompt_too_long", "prompt has"),
    "prompt text over the context": ({"json": json.dumps({"prompt": "hello " * 2000})}, None,
                                     "prompt_too_long", "prompt has"),
    "out-of-vocabulary prompt id": ({"json": '{"prompt_token_ids": [1, 2, 100000]}'}, None,
                                    "invalid_token_id", "100000"),
    "negative prompt id": ({"json": '{"prompt_token_ids": [1, -1]}'}, None, "invalid_request",
                           "$.prompt_token_ids"),
    "out-of-vocabulary stop id": ({"json": '{"prompt": "Hi", "stop_token_ids": [100000]}'}, None,
                                  "invalid_token_id", "100000"),
    "oversized payload": ({"json": json.dumps({"prompt": "x" * (2 << 20)})}, None,
                          "invalid_request", "bytes"),
    "oversized payload with its own id": ({"json": json.dumps({"id": "big-2",
                                                               "prompt": "x" * (2 << 20)})},
                                          "big-2", "invalid_request", "bytes"),
    "deep nesting": ({"json": '{"prompt": "Hi", "metadata": {"a": ' + "[" * DEEP + "]" * DEEP
                      + "}}"}, None, "invalid_request", ""),
    "bad request id": ({"json": '{"id": "no spaces {allowed}", "prompt": "Hi"}'}, None,
                       "invalid_request", "$.id"),
    "request id with newline": ({"json": json.dumps({"id": "abc\n", "prompt": "Hi"})}, None,
                                "invalid_request", "$.id"),
    "bad id in valid msgpack": ({"msgpack": msgspec.msgpack.encode({"id": "x" * 200,
                                                                    "prompt": "Hi"})},
                                None, "invalid_request", "$.id"),
    "own id, bad field": ({"json": '{"id": "mine-1", "prompt": "Hi", "top_k": "many"}'},
                          "mine-1", "invalid_request", "$.top_k"),
}


@pytest.fixture(scope="module")
def table_worker(redis_server, tiny_model_path: Path, tmp_path_factory):
    worker = WorkerProcess(redis_server.url, tiny_model_path,
                           tmp_path_factory.mktemp("bad-input-logs"), "table-worker").start()
    try:
        yield worker
    finally:
        worker.stop()


def outcome(r: redis.Redis, entry_id: str, request_id: str | None) -> tuple[str, str, str]:
    """Where the entry ended: ("error", code, message) on its result stream, or ("dlq", ...)."""
    def ended() -> tuple[str, str, str] | None:
        for rid in {request_id or entry_id, entry_id}:
            for event in terminal_events(read_events(r, rid)):
                if isinstance(event, protocol.Error):
                    return "error", event.code, event.message
                return "done", event.finish_reason, ""
        for letter, _ in dead_letters(r):
            if letter.entry_id == entry_id:
                return "dlq", letter.code, letter.message
        return None
    return wait_for(ended, 30, f"the outcome of entry {entry_id}")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_its_error_and_the_worker_lives_on(case, table_worker, redis_client) -> None:
    fields, request_id, code, text = CASES[case]
    # Given a running worker
    table_worker.wait_ready(redis_client)
    # When a bad entry is queued
    entry_id = redis_client.xadd(QUEUE_KEY, fields).decode()
    # Then it ends with its code (on its result stream, or dead-lettered when it names no
    # usable id), the message names the field, and the entry is acked
    where, got_code, message = outcome(redis_client, entry_id, request_id)
    assert (got_code, where != "done") == (code, True), (where, got_code, message)
    assert text in message, message
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the entry to be acked")
    if where == "error":
        assert not any(isinstance(e, protocol.Start)
                       for e in read_events(redis_client, request_id or entry_id))
    # And the same worker process is alive and serves a good request
    assert table_worker.alive(), table_worker.log_tail()
    good = redis_client.xadd(QUEUE_KEY, {"json": '{"prompt": "Hi", "max_tokens": 4}'}).decode()
    done = wait_terminal(redis_client, good)
    assert isinstance(done, protocol.Done), done
    table_worker.wait_ready(redis_client)
    beat = protocol.decode_heartbeat(redis_client.hgetall(KEYS.worker("table-worker")))
    assert beat.pid == table_worker.pid


# Entries no usable id can be read from: each is answered on llmq:r:<entry id> (the stream an
# id-less producer follows: the XADD reply is all it knows) AND kept in the dead-letter stream.
ID_LESS: dict[str, dict[str, Any]] = {
    "truncated json": {"json": '{"prompt": "Hi", "max_tok'},
    "garbage bytes": {"json": b"\x00\xff\xfe garbage \x81"},
    "garbage msgpack": {"msgpack": b"\xc1\xc1\xc1"},
    "wrong field name": {"payload": '{"prompt": "Hi"}'},
    "5 MB payload": {"json": json.dumps({"prompt": "x" * (5 << 20)})},
    "17 MB payload, too large to read for its id": {
        "json": json.dumps({"id": "big-1", "prompt": "x" * (17 << 20)})},
    "lone surrogate": {"json": b'{"prompt": "\xed\xa0\x80"}'},
    "escaped lone surrogate": {"json": '{"prompt": "\\ud800"}'},
    "deep nesting": {"json": '{"prompt": "Hi", "metadata": {"a": ' + "[" * DEEP + "]" * DEEP
                     + "}}"},
    "non-object top level": {"json": '"just a string"'},
    "bad id": {"json": '{"id": "has space", "prompt": "Hi"}'},
    "id of the entry-id form": {"json": '{"id": "1700000000000-0", "prompt": "Hi"}'},
    "invalid utf-8 in msgpack": {"msgpack": b"\x81\xa6prompt\xa2\xff\xfe"},
}


@pytest.mark.parametrize("case", list(ID_LESS))
def test_entry_without_a_usable_id_is_answered_on_its_entry_id(case, table_worker,
                                                               redis_client) -> None:
    # Given a running worker
    table_worker.wait_ready(redis_client)
    # When an entry that names no usable id is queued
    entry_id = redis_client.xadd(QUEUE_KEY, ID_LESS[case]).decode()
    # Then the producer, following llmq:r:<entry id>, gets an invalid_request error there
    error = wait_terminal(redis_client, entry_id)
    assert isinstance(error, protocol.Error) and error.code == "invalid_request", error
    assert error.request_id == entry_id and error.attempt == 1
    # And the entry is dead-lettered with its payload for people, and acked
    wait_for(lambda: any(letter.entry_id == entry_id for letter, _ in dead_letters(redis_client)),
             10, "the dead letter")
    wait_for(lambda: num_pending(redis_client) == 0, 10, "the entry to be acked")
    assert table_worker.alive(), table_worker.log_tail()


def test_an_oversized_payload_with_a_tenant_id_is_answered_where_the_tenant_reads(
        table_worker, redis_server, redis_client) -> None:
    from llmq.broker.client import Client
    from llmq.broker.commands import Submission
    from llmq.broker.functions import ensure_functions

    table_worker.wait_ready(redis_client)
    ensure_functions(redis_client)
    payload = json.dumps({"id": "acme:big-3", "prompt": "x" * (2 << 20)}).encode()
    with Client(redis_server.url) as client:
        # Given a tenant's submit function queuing a payload over the cap (a producer that
        # skipped the client's own check), its id marked for that entry
        args = client._fcall_args(Submission("acme:big-3", "json", payload), "default")
        entry_id = protocol.as_str(redis_client.fcall(*args)[1])
        # Then the tenant, following its own id, gets the invalid_request error there
        error = wait_terminal(redis_client, "acme:big-3")
        assert isinstance(error, protocol.Error) and error.code == "invalid_request", error
        assert "bytes" in error.message
        # But an entry someone XADDed with a tenant's id (unmarked) answers on its entry id
        # only: it cannot write to the tenant's stream
        forged = json.dumps({"id": "acme:big-4", "prompt": "x" * (2 << 20)})
        forged_entry = redis_client.xadd(QUEUE_KEY, {"json": forged}).decode()
        error = wait_terminal(redis_client, forged_entry)
        assert isinstance(error, protocol.Error) and error.request_id == forged_entry
        assert read_events(redis_client, "acme:big-4") == []
    assert entry_id and table_worker.alive(), table_worker.log_tail()
