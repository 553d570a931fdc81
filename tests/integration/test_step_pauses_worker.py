"""A worker's running batch step pauses for an interactive request that arrives meanwhile
(worker/engine/step_interrupt.py): admission signals the engine once the request is in the busy
loop's inbox, so the interactive answer comes before the batch step's tokens, on a real server."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from llmq import protocol
from llmq.broker import Client
from tests.integration.worker_harness import KEYS, InProcessWorker, wait_terminal

pytestmark = pytest.mark.redis


def _request(i: int, **fields: object) -> dict[str, object]:
    return {"prompt_token_ids": [5 + (i * 7 + j) % 50 for j in range(16)], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **fields}


def _first_token_ms(r: redis.Redis, request_id: str) -> int:
    """Server ms of the request's first delta (or its done, for a one-event stream)."""
    for entry_id, fields in r.xrange(KEYS.result(request_id)):
        if isinstance(protocol.decode_event(fields), protocol.Delta | protocol.Done):
            return int(entry_id.decode().partition("-")[0])
    raise AssertionError(f"no token for {request_id}")


def test_an_interactive_request_is_answered_while_the_batch_step_it_met_waits(
        redis_server, redis_client, tiny_model) -> None:
    worker = InProcessWorker(redis_server.url, tiny_model, max_num_seqs=8)
    # NOTE: the tiny model's steps take milliseconds: the first batch step is held after its
    # first layer until an interactive arrival is signalled (at most 60 s), as a long step
    # would be still running when one arrives.
    interrupt = worker.engine.step_interrupt
    pause_after = interrupt._pause_after
    holding = threading.Event()

    def held_pause_after(layer: int) -> bool:
        if not holding.is_set():
            holding.set()
            deadline = time.monotonic() + 60
            while not pause_after(layer) and time.monotonic() < deadline:
                time.sleep(0.01)
        return pause_after(layer)

    interrupt._pause_after = held_pause_after
    with worker, Client(redis_server.url) as client:
        # Given batch requests whose first step is running
        batch = client.submit_many([_request(i, lane="batch") for i in range(6)])
        assert holding.wait(60), "no batch step started"
        # When an interactive request arrives
        online = client.submit_many([_request(99)])[0]
        finals = [wait_terminal(redis_client, r, timeout=60) for r in [online, *batch]]
    # Then the batch step paused for it, its answer came before any batch token, and every
    # request finished
    assert all(isinstance(f, protocol.Done) for f in finals), finals
    assert interrupt.num_paused >= 1
    assert _first_token_ms(redis_client, online) <= min(
        _first_token_ms(redis_client, r) for r in batch)
