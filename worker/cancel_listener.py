"""CancelListener: follows `llmq:cancel:{<queue>}` and aborts in-flight requests it names.

Every worker of a queue reads the whole cancel stream (plain XREAD, no group: a cancel concerns
whichever worker holds the request), from the stream's last entry at start. A cancel for a request
in flight flags its entries and asks the busy loop to abort them, so generation stops within one
step and the terminal event says `done{finish_reason: cancelled}`. Requests not read yet are
covered by the `llmq:x:{<request_id>}` flag, which admission checks (worker/admission.py).

**Only the owner cancels.** Anyone who may submit may XADD to the cancel stream, naming any id;
only the request's owner may set its cancel flag (a tenant's flags are `llmq:t:x:{<tenant>:*`,
the shared producer's `llmq:x:*`: broker/keys.py). So an entry is a request to look, not an
order: a request in flight is aborted only while its flag is set, and the clients set the flag
before they add the entry (broker/client_base.py).

Reading, outages and a recreated stream are worker/stream_follower.py's.
"""

from __future__ import annotations

import logging

from llmq import protocol
from llmq.broker import replies
from llmq.broker.replies import Fields
from llmq.worker.backoff import REDIS_ERRORS
from llmq.worker.inbox import AbortRequests
from llmq.worker.stream_follower import StreamFollower
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)


class CancelListener(StreamFollower):
    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, ctx.keys.cancel(ctx.queue), name="cancel listener")
        self.keys = ctx.keys
        self.table = ctx.table
        self.inbox = ctx.inbox

    def handle(self, entry_id: str, fields: Fields) -> None:
        request_id = protocol.decode_cancel(fields)
        if request_id is not None:
            self.cancel(request_id)

    def cancel(self, request_id: str) -> list[str]:
        """Abort the request's entries in flight here if its owner flagged it; their ids."""
        if not self.table.by_request_id(request_id):
            return []
        if not self._flagged(request_id):
            logger.warning("cancel entry for %s without its cancel flag: ignored (only the "
                           "request's owner can cancel it)", request_id)
            return []
        entry_ids = self.table.request_cancel(request_id)
        if entry_ids:
            logger.info("cancel %s: aborting entries %s", request_id, entry_ids)
            self.inbox.put(AbortRequests(entry_ids))
        return entry_ids

    def _flagged(self, request_id: str) -> bool:
        """Whether the request's cancel flag is set; False when Redis cannot say (a request is
        never aborted on a guess: its owner can cancel again)."""
        for attempt in range(3):
            try:
                return bool(replies.integer(
                    self.client.exists(self.keys.cancel_flag(request_id)), "EXISTS"))
            except REDIS_ERRORS as e:
                logger.warning("cancel of %s: cannot read its cancel flag (%s)", request_id, e)
                self.stop_event.wait(0.2 * (attempt + 1))
        return False
