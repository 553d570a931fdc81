"""Who may write a request id's result stream: the one entry that owns the id.

A worker owns an id for an entry with `SET llmq:id:{<queue>}:<id> <entry id> NX GET` when it
admits it (the producer's submit function has set that marker already when it queued the entry).
Another entry with the same id, raw-XADDed while the first runs or after it finished, is a
duplicate: it is dead-lettered as `duplicate_id` and answered on llmq:r:{<its entry id>}, and
the first run's stream keeps exactly one start and one terminal event. """

from __future__ import annotations

import pytest

from llmq import protocol
from llmq.broker import Client
from tests.integration.worker_harness import (
    InProcessWorker,
    dead_letters,
    num_pending,
    read_events,
    terminal_events,
    wait_for,
    wait_terminal,
    xadd_json,
)

pytestmark = pytest.mark.redis


def starts(events: list[protocol.Event]) -> list[protocol.Start]:
    return [e for e in events if isinstance(e, protocol.Start)]


def test_a_second_raw_entry_with_a_running_or_finished_id_is_a_duplicate(
        redis_server, redis_client, tiny_model) -> None:
    # Given a worker running a request with its own id
    with InProcessWorker(redis_server.url, tiny_model, fault="slow_step:20"):
        first = xadd_json(redis_client, {"id": "dup-1", "prompt_token_ids": [5, 6, 7],
                                         "max_tokens": 24, "ignore_eos": True})
        wait_for(lambda: starts(read_events(redis_client, "dup-1")), 30, "the first to start")
        # When another producer XADDs an entry with the same id while it runs
        running_dup = xadd_json(redis_client, {"id": "dup-1", "prompt": "other text",
                                               "max_tokens": 4})
        error = wait_terminal(redis_client, running_dup)
        done = wait_terminal(redis_client, "dup-1")
        # ... and once more after it finished
        finished_dup = xadd_json(redis_client, {"id": "dup-1", "prompt": "again",
                                                "max_tokens": 4})
        late_error = wait_terminal(redis_client, finished_dup)
        wait_for(lambda: num_pending(redis_client) == 0, 10, "every entry acked")
    # Then each duplicate is answered on its own entry id with duplicate_id, naming the owner
    for dup, err in ((running_dup, error), (finished_dup, late_error)):
        assert isinstance(err, protocol.Error) and err.code == "duplicate_id", err
        assert err.request_id == dup and first in err.message
        assert err.details == {"request_id": "dup-1", "owner_entry_id": first}
    # And dead-lettered (with no request id, so a retry cannot touch the owner's stream)
    letters = {letter.entry_id: letter for letter, _ in dead_letters(redis_client)}
    assert {running_dup, finished_dup} <= letters.keys()
    assert all(letters[d].code == "duplicate_id" and letters[d].request_id is None
               for d in (running_dup, finished_dup))
    # And the first run's stream is untouched: one start, one done, its own deltas only
    events = read_events(redis_client, "dup-1")
    assert [e.attempt for e in starts(events)] == [1]
    assert terminal_events(events) == [done] and isinstance(done, protocol.Done)
    assert done.usage.completion_tokens == 24
    assert "".join(e.text for e in events if isinstance(e, protocol.Delta)) == done.text


def test_a_submit_of_an_id_a_raw_entry_already_owns_queues_nothing(
        redis_server, redis_client, tiny_model) -> None:
    # Given a request with its own id, XADDed raw and finished
    with InProcessWorker(redis_server.url, tiny_model):
        xadd_json(redis_client, {"id": "raw-1", "prompt": "Hi", "max_tokens": 4})
        done = wait_terminal(redis_client, "raw-1")
        # When the llmq client submits the same id
        with Client(redis_server.url) as client:
            length = client.stats().length
            assert client.submit("Hi", request_id="raw-1", max_tokens=4) == "raw-1"
            # Then nothing is queued: the id is owned, its result is the one there
            assert client.stats().length == length
            assert client.result("raw-1", timeout=10) == done
