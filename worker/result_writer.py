"""ResultWriter: the worker's output thread; events to result streams, then XACK.

After vLLM v1's EngineCoreProc output thread (the busy loop hands over a step's outputs and goes
back to the model; serialising and socket IO happen on another thread) and dramatiq/arq's rule
"ack only after the result is written": a stream entry is XACKed in the same MULTI/EXEC as its
terminal event, after it, so an entry is never acked without its result and the write is
all-or-nothing (an OOM-refused XADD aborts the whole transaction, XACK included).

Everything that reaches a result stream goes through this one FIFO thread: `start` events from
admission, a step's `delta`s and terminal events from the busy loop, admission errors and dead
letters. So a request's events stay in order. One transaction per batch of queued items: one
step's events are written together, with `XADD ... MAXLEN ~ result_maxlen` on each result stream
and `EXPIRE result_ttl` once per stream touched (an abandoned stream still expires).

When Redis is unreachable the batch is kept and retried with capped backoff, never dropped. A
retry after an ambiguous failure (EXEC sent, reply lost) first asks XPENDING whether the batch's
acks landed; if they did, the whole transaction did, and it is not written twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from llmq.broker import protocol
from llmq.broker.commands import queue_events
from llmq.broker.keys import GROUP
from llmq.broker.protocol import Encoding, Event
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# At most this many queued items go into one transaction, so a backlog after an outage is
# written in bounded pieces rather than one huge MULTI.
MAX_ITEMS_PER_BATCH = 256

# KEYS[1] request stream; ARGV: group, consumer, entry ids...
# XACK only the entries still pending under this consumer; return the ones a peer owns now.
# NOTE: a plain XACK removes an entry from the PEL whoever owns it: a stalled worker finishing
# late would ack the entry a peer reclaimed and is running as the next attempt, which then could
# never be reclaimed again if that peer died. Its late terminal event (a lower attempt) is
# harmless: readers follow the highest attempt.
_ACK_OWNED = """
local mine, taken = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then mine[#mine + 1] = ARGV[i] else taken[#taken + 1] = ARGV[i] end
  end
end
if #mine > 0 then redis.call('XACK', KEYS[1], ARGV[1], unpack(mine)) end
return taken
"""


@dataclass
class EntryWrite:
    """Events for one entry from outside the engine (admission, reclaim), optionally final."""

    entry_id: str
    request_id: str | None  # None: no result stream to write to (dead letter only)
    encoding: Encoding
    events: list[Event]
    ack: bool = False  # XACK the entry after its events: this write is its last
    dead_letter: dict[str, bytes] | None = None  # fields to XADD to the dead-letter stream
    pop: bool = True  # forget the entry once acked (False for entries never in the table)


@dataclass
class _Batch:
    events: list[tuple[Event, Encoding]] = field(default_factory=list)  # in order
    dead_letters: list[dict[str, bytes]] = field(default_factory=list)
    ack_ids: list[str] = field(default_factory=list)
    pop_ids: list[str] = field(default_factory=list)  # forgotten after the write
    # For metrics: each finished request's terminal event, with the output that ended it.
    finished: list[tuple[protocol.Done | protocol.Error, EngineCoreOutput]] = field(
        default_factory=list)
    errors: list[str] = field(default_factory=list)  # codes of admission errors, for metrics

    @property
    def num_writes(self) -> int:
        return len(self.events) + len(self.dead_letters)


class ResultWriter:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.client = ctx.connect()
        self.table = ctx.table
        self.metrics = ctx.metrics
        self.queue_key = ctx.queue_key
        self.handbacks_key = ctx.keys.handbacks(ctx.queue)
        self.dlq_key = ctx.keys.dlq(ctx.queue)
        self._ack_owned = self.client.register_script(_ACK_OWNED)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._give_up_at: float | None = None
        self.backoff = Backoff("result writer", ctx.state, stop=None)
        self.num_abandoned = 0
        self._thread = threading.Thread(target=self._run, name="llmq-result-writer", daemon=True)

    # -- called by other threads ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def put_step(self, outputs: list[EngineCoreOutput]) -> None:
        """One engine step's outputs (busy loop)."""
        self._queue.put(outputs)

    def put(self, write: EntryWrite) -> None:
        """Events from admission or reclaim (input thread, lease keeper)."""
        self._queue.put(write)

    def stop(self, timeout: float) -> bool:
        """Write what is queued, then end; give up on Redis after `timeout` s. True if flushed."""
        self._give_up_at = time.monotonic() + timeout
        self._queue.put(None)
        self._thread.join(timeout + 1.0)
        return not self._thread.is_alive() and self.num_abandoned == 0

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while len(items) < MAX_ITEMS_PER_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if any(i is None for i in items):
                stopping = True
                items = [i for i in items if i is not None]
            batch = _Batch()
            for item in items:
                if isinstance(item, EntryWrite):
                    self._add_entry_write(batch, item)
                else:
                    for output in item:
                        self._add_output(batch, output)
            if batch.num_writes or batch.ack_ids:
                self._write(batch)
            self._after_write(batch)
        logger.debug("result writer stopped")

    def _add_entry_write(self, batch: _Batch, write: EntryWrite) -> None:
        if write.dead_letter is not None:
            batch.dead_letters.append(write.dead_letter)
        if write.request_id is not None:
            for event in write.events:
                batch.events.append((event, write.encoding))
                if isinstance(event, protocol.Error):
                    batch.errors.append(event.code)
        if write.ack:
            batch.ack_ids.append(write.entry_id)
            if write.pop:
                batch.pop_ids.append(write.entry_id)

    def _add_output(self, batch: _Batch, output: EngineCoreOutput) -> None:
        entry = self.table.get(output.request_id)
        if entry is None:
            logger.warning("output for unknown entry %s dropped", output.request_id)
            return
        if entry.fenced:
            # A peer owns the entry now (lease lost): write nothing more, and forget it once the
            # engine has let go of it. Never ack: the peer's attempt will.
            if output.finished and protocol.gather_choices(entry.finished_choices, output,
                                                           entry.n) is not None:
                self.table.pop(entry.entry_id)
            return
        if entry.stream and (output.new_token_ids or output.new_text):
            delta = protocol.Delta(
                request_id=entry.request_id, attempt=entry.attempt, seq=entry.seq,
                text=output.new_text, token_ids=list(output.new_token_ids),
                logprobs=output.new_logprobs or None, index=output.index)
            entry.seq += 1
            batch.events.append((delta, entry.encoding))
        if not output.finished:
            return
        # NOTE: one terminal event per attempt, once every one of the n completions finished.
        outputs = protocol.gather_choices(entry.finished_choices, output, entry.n)
        if outputs is None:
            return
        entry.terminal = True
        terminal = protocol.terminal_event(entry.request_id, entry.attempt, outputs,
                                           entry.metadata)
        batch.events.append((terminal, entry.encoding))
        batch.ack_ids.append(entry.entry_id)
        batch.pop_ids.append(entry.entry_id)
        batch.finished.append((terminal, output))

    # -- writing ----------------------------------------------------------------------------------

    def _write(self, batch: _Batch) -> None:
        ambiguous = False
        while True:
            if ambiguous and batch.ack_ids and self._acks_landed(batch.ack_ids):
                logger.info("a batch of %d acks was applied before the connection broke: not "
                            "written again", len(batch.ack_ids))
                self.backoff.succeeded()
                return
            try:
                self._execute(batch)
                self.backoff.succeeded()
                return
            except (*TRANSIENT_ERRORS, redis.ResponseError) as e:  # type: ignore[misc]
                # NOTE: a refusal (OOM under noeviction, BUSY, MASTERDOWN, or NOPERM during a
                # rollout) aborts the whole MULTI: nothing was written or acked, so retry with
                # backoff like an outage rather than let the thread, and the worker, die.
                ambiguous = isinstance(e, TRANSIENT_ERRORS)
                if self._give_up_at is not None and time.monotonic() > self._give_up_at:
                    self.num_abandoned += batch.num_writes
                    logger.error("shutting down with Redis unreachable: %d events and %d acks "
                                 "not written (their entries stay pending and are reclaimed)",
                                 batch.num_writes, len(batch.ack_ids))
                    batch.pop_ids.clear()
                    batch.finished.clear()
                    return
                self.backoff.failed(e)

    def _queue_writes(self, pipe: Any, batch: _Batch) -> None:
        """Dead letters, then events (XADD capped, one EXPIRE per result stream)."""
        for fields in batch.dead_letters:
            pipe.xadd(self.dlq_key, fields)
        queue_events(pipe, self.ctx.keys, batch.events, result_ttl=self.ctx.config.result_ttl,
                     result_maxlen=self.ctx.config.result_maxlen)

    def _execute(self, batch: _Batch) -> None:
        pipe = self.client.pipeline(transaction=True)
        self._queue_writes(pipe, batch)
        if batch.ack_ids:
            pipe.hdel(self.handbacks_key, *batch.ack_ids)
            self._ack_owned(keys=[self.queue_key],
                            args=[GROUP, self.ctx.worker_id, *batch.ack_ids], client=pipe)
        results = pipe.execute(raise_on_error=False)
        for result in results[:-1] if batch.ack_ids else results:
            if isinstance(result, Exception):
                # NOTE: a command refused at EXEC time (WRONGTYPE on a key someone else created)
                # will never succeed: log it and go on rather than retry forever.
                logger.error("a result write failed: %s", result)
        if batch.ack_ids and isinstance(results[-1], Exception):
            logger.warning("XACK failed (%s): entries stay pending", results[-1])
        elif batch.ack_ids and results[-1]:
            taken = [protocol.as_str(t) for t in results[-1]]
            logger.warning("not acking %d entr%s a peer reclaimed meanwhile: %s", len(taken),
                           "y" if len(taken) == 1 else "ies", taken[:5])

    def _acks_landed(self, ack_ids: list[str]) -> bool:
        """After an ambiguous failure: True when every acked entry is still in the stream but no
        longer pending, i.e. the transaction ran. When the entries are gone altogether (Redis
        came back without its data) nothing can be known: write again, a duplicate beats a loss.
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            for entry_id in ack_ids:
                pipe.xpending_range(self.queue_key, GROUP, min=entry_id, max=entry_id, count=1)
                pipe.xrange(self.queue_key, min=entry_id, max=entry_id, count=1)
            results = pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS:
            return False
        if any(isinstance(r, Exception) for r in results):
            return False  # NOGROUP: the group is gone, so write the events again to be sure
        pending, present = results[0::2], results[1::2]
        return all(not p for p in pending) and all(present)

    def _after_write(self, batch: _Batch) -> None:
        for entry_id in batch.pop_ids:
            self.table.pop(entry_id)
        finished = [_figures(terminal, output) for terminal, output in batch.finished]
        if finished or batch.errors:
            self.ctx.counters.add_finished([t.ttft for _, _, _, t in finished]
                                           + [None] * len(batch.errors))
        if self.metrics is None:
            return
        for reason, code, usage, t in finished:
            self.metrics.observe_finished(
                reason, code, usage.prompt_tokens, usage.completion_tokens,
                usage.cached_prompt_tokens, t.queue, t.ttft, t.e2e, t.per_token)
        for code in batch.errors:
            self.metrics.observe_finished("error", code, 0, 0, 0, None, None, 0.0, None)
        if batch.dead_letters:
            self.metrics.inc_dead_letters(len(batch.dead_letters))


def _figures(terminal: protocol.Done | protocol.Error, output: EngineCoreOutput
             ) -> tuple[str, str | None, protocol.Usage, protocol.Timings]:
    """(finish reason, error code, usage, timings) of a finished request, for the counters."""
    # NOTE: a `done` counts the n completions of a request once (its prompt once).
    if isinstance(terminal, protocol.Done):
        return terminal.finish_reason, None, terminal.usage, terminal.timings
    return ("error", terminal.code, output.usage or protocol.Usage(0, 0, 0),
            output.timings or protocol.Timings(0.0, None, 0.0, None))
