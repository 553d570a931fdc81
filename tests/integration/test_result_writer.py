"""The result writer against real servers: a lost EXEC reply never writes an event twice.

A connection that breaks after Redis applied the transaction but before its reply arrived
(CLIENT KILL, a Redis crash after the AOF write) leaves the writer not knowing whether its
batch landed. It must find out before writing again: a delta written twice would repeat its
`seq`, and a reader concatenating deltas would show text twice.
"""

from __future__ import annotations

import pytest
import redis

from llmq import protocol
from llmq.broker.keys import GROUP
from llmq.worker.result_writer import EntryWrite, ResultWriter
from llmq.worker.worker_config import WorkerConfig
from llmq.worker.worker_context import WorkerContext
from tests.integration.worker_harness import (
    QUEUE_KEY,
    num_pending,
    read_events,
    wait_for,
    xadd_json,
)

pytestmark = pytest.mark.redis


class ReplyLostOnce(ResultWriter):
    """Applies its first transaction, then fails as if the reply never came."""

    lost = 0

    def _execute(self, batch) -> None:
        super()._execute(batch)
        if not self.lost:
            self.lost += 1
            raise redis.ConnectionError("reply lost (test)")


@pytest.mark.parametrize("with_ack", [False, True])
def test_a_batch_whose_reply_was_lost_is_not_written_again(redis_server, redis_client,
                                                           with_ack: bool) -> None:
    # Given a result writer whose first EXEC lands but whose reply is lost
    ctx = WorkerContext(WorkerConfig(redis_url=redis_server.url, worker_id="w"), "tiny", 4)
    writer = ReplyLostOnce(ctx)
    writer.start()
    deltas = [protocol.Delta(request_id="r-1", attempt=1, seq=i, text=f"t{i}", token_ids=[i])
              for i in range(3)]
    # ... for an entry this worker read
    redis_client.xgroup_create(QUEUE_KEY, GROUP, id="0", mkstream=True)
    entry_id = xadd_json(redis_client, {"id": "r-1", "prompt": "Hi"})
    redis_client.xreadgroup(GROUP, "w", {QUEUE_KEY: ">"})
    # When it writes a batch of deltas (with or without the entry's ack)
    writer.put(EntryWrite(entry_id, "r-1", "json", list(deltas), ack=with_ack, pop=False))
    assert writer.stop(timeout=10)
    # Then each delta is on the stream once: the retry saw the batch had landed
    wait_for(lambda: writer.lost, 5, "the lost reply")
    assert [e.seq for e in read_events(redis_client, "r-1")] == [0, 1, 2]
    assert num_pending(redis_client) == (0 if with_ack else 1)
