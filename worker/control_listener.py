"""ControlListener: follows `llmq:ctl:{<queue>}`, hands utility calls to the busy loop, and writes
the answers to `llmq:ctlr:<call_id>`.

Like the cancel listener, every worker reads the whole control stream with a plain XREAD from
its end at start (its own position, not the consumer group: a call is for every worker, or the
one it names). The call itself runs on the busy loop (worker/utility_calls.py), which owns the
engine; its answer comes back here through `answer()` and is written between two reads, so the
busy loop never waits on Redis. Answers wait at most one `ANSWER_BLOCK_MS` read slice.
"""

from __future__ import annotations

import logging
import queue

from llmq.broker.control import queue_reply
from llmq.broker.replies import Fields
from llmq.protocol import ControlReply, decode_call
from llmq.worker.backoff import REDIS_ERRORS
from llmq.worker.inbox import UtilityCall
from llmq.worker.stream_follower import StreamFollower
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# NOTE: short, so an answer queued by the busy loop is written soon after the call ran.
ANSWER_BLOCK_MS = 200


class ControlListener(StreamFollower):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, ctx.keys.control(ctx.queue), name="control listener",
                         block_ms=ANSWER_BLOCK_MS)
        self.keys = ctx.keys
        self.worker_id = ctx.worker_id
        self.inbox = ctx.inbox
        self._answers: queue.SimpleQueue[ControlReply] = queue.SimpleQueue()

    def answer(self, reply: ControlReply) -> None:
        """Queue an answer for writing (busy loop)."""
        self._answers.put(reply)

    def handle(self, entry_id: str, fields: Fields) -> None:
        call = decode_call(fields)
        if call is None:
            logger.warning("control entry %s is not a call: ignored", entry_id)
        elif call.worker in (None, self.worker_id):
            logger.info("utility call %s: %s %s", call.call_id, call.method, call.args)
            self.inbox.put(UtilityCall(call))

    def before_read(self) -> None:
        """Write the answers the busy loop queued."""
        while True:
            try:
                reply = self._answers.get_nowait()
            except queue.Empty:
                return
            try:
                pipe = self.client.pipeline(transaction=True)
                queue_reply(pipe, self.keys, reply)
                pipe.execute()
            except REDIS_ERRORS:
                # NOTE: an answer is worth a retry (after the follower's backoff), not a loss.
                logger.warning("answer to %s not written yet: retrying", reply.call_id)
                self._answers.put(reply)
                raise
