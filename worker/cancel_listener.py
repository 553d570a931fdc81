"""CancelListener: follows `llmq:cancel:{<queue>}` and aborts in-flight requests it names.

Every worker of a queue reads the whole cancel stream (plain XREAD, no group: a cancel concerns
whichever worker holds the request), from the stream's last entry at start. A cancel for a request
in flight flags its entries and asks the busy loop to abort them, so generation stops within one
step and the terminal event says `done{finish_reason: cancelled}`. Requests not read yet are
covered by the `llmq:x:{<request_id>}` flag, which admission checks (worker/admission.py).

Reading, outages and a recreated stream are worker/stream_follower.py's.
"""

from __future__ import annotations

import logging

from llmq import protocol
from llmq.broker.replies import Fields
from llmq.worker.inbox import AbortRequests
from llmq.worker.stream_follower import StreamFollower
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)


class CancelListener(StreamFollower):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, ctx.keys.cancel(ctx.queue), name="cancel listener")
        self.table = ctx.table
        self.inbox = ctx.inbox

    def handle(self, entry_id: str, fields: Fields) -> None:
        request_id = protocol.decode_cancel(fields)
        if request_id is not None:
            self.cancel(request_id)

    def cancel(self, request_id: str) -> list[str]:
        entry_ids = self.table.request_cancel(request_id)
        if entry_ids:
            logger.info("cancel %s: aborting entries %s", request_id, entry_ids)
            self.inbox.put(AbortRequests(entry_ids))
        return entry_ids
