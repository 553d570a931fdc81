"""EngineFeeder: the busy loop's input side, from the inbox into the engine.

After vLLM v1's `EngineCoreProc._handle_client_request`: between two steps the busy loop
(worker/worker.py) drains the inbox the IO threads fill (worker/inbox.py) and hands each item to
the engine, which only that thread touches:

- one read's admitted requests are added in order before the next step (their prefills share
  it); a suspect (`AddRequest.solo`, an entry that was in an engine that failed) waits for the
  engine to empty, and nothing joins it while it runs;
- aborts go in after the adds queued before them, and need one step to deliver their
  `cancelled` outputs;
- a utility call runs (worker/utility_calls.py) and its answer goes back to the control
  listener.

A request the engine refuses ends with its `error` through the result writer; one admitted just
before the worker fell asleep is handed back to peers instead of run.
"""

from __future__ import annotations

import collections
import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmq import protocol
from llmq.protocol import ControlReply
from llmq.protocol.errors import RequestRejected
from llmq.worker.inbox import AbortRequests, AddRequest, Inbox, InboxItem, UtilityCall
from llmq.worker.result_batch import EntryWrite

if TYPE_CHECKING:
    from llmq.worker.engine_client import EngineClient
    from llmq.worker.inflight_table import InFlightTable
    from llmq.worker.result_writer import ResultWriter
    from llmq.worker.utility_calls import UtilityCalls

__all__ = ["EngineFeeder"]

logger = logging.getLogger(__name__)


class EngineFeeder:
    """`answer(reply)` sends a utility call's reply back (after the busy loop's own bookkeeping)."""

    def __init__(self, engine: EngineClient, table: InFlightTable, inbox: Inbox,
                 writer: ResultWriter, utility: UtilityCalls, *,
                 answer: Callable[[ControlReply], None]) -> None:
        self.engine = engine
        self.table = table
        self.inbox = inbox
        self.writer = writer
        self.utility = utility
        self.answer = answer
        self._held: collections.deque[AddRequest] = collections.deque()  # admitted, not added
        self._solo: str | None = None  # the suspect running alone, while it runs

    @property
    def num_held(self) -> int:
        """Requests admitted and waiting for their turn in the engine (a suspect's, mostly)."""
        return len(self._held)

    def drain_inbox(self, block: float) -> bool:
        """Feed queued adds and aborts to the engine, waiting up to `block` seconds for the
        first item when nothing is held; True when an abort needs a step."""
        aborted = False
        item: InboxItem | None
        self.engine.step_interrupt.clear()  # what asked a step to give way is added below
        try:
            item = self.inbox.get(timeout=block) if block and not self._held else \
                self.inbox.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            if isinstance(item, list):  # one read's requests, added before the next step
                self._held.extend(item)
            elif isinstance(item, AbortRequests):
                aborted |= self._add_held()  # adds queued before the abort go in first
                self.engine.abort(item.entry_ids)
                aborted = True
            elif isinstance(item, UtilityCall):
                self.answer(self.utility.run(item.call))
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None
        return self._add_held() or aborted

    def _add_held(self) -> bool:
        """Add held requests in order; a suspect (`solo`) waits for the engine to empty, and
        nothing joins it while it runs. True when an abort needs a step."""
        aborted = False
        while self._held:
            running = self.engine.has_unfinished_requests()
            if self._solo is not None and running:
                break  # a suspect runs alone
            self._solo = None
            add = self._held[0]
            if add.solo and running:
                break  # it waits for the engine to empty, and so does whatever came after it
            self._held.popleft()
            aborted |= self._add(add)
            if add.solo and self.engine.has_unfinished_requests():
                self._solo = add.entry_id
                logger.info("running suspect entry %s alone", add.entry_id)
        return aborted

    def _add(self, item: AddRequest) -> bool:
        entry = self.table.get(item.entry_id)
        if entry is None or entry.fenced:
            self.table.pop(item.entry_id)
            return False
        if self.utility.sleep_level:
            self.utility.hand_back_admitted(item.entry_id)  # read just before the sleep
            return False
        try:
            self.engine.add_request(item.entry_id, item.prompt_token_ids, item.sampling_params,
                                    priority=item.priority, arrival_time=item.arrival_time,
                                    batch=item.batch)
            entry.in_engine = True
        except RequestRejected as e:
            error = protocol.Error(request_id=entry.request_id, attempt=entry.attempt,
                                   code=e.code, message=e.message, metadata=entry.metadata)
            entry.terminal = True
            self.writer.put(EntryWrite(entry.entry_id, entry.request_id, entry.encoding, [error],
                                       ack=True))
            return False
        if entry.cancel_requested:
            # The cancel arrived while the request was being admitted.
            self.engine.abort([item.entry_id])
            return True
        return False
