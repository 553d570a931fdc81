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
acks landed (a batch without acks: whether its last event is on its stream, known by type,
attempt and seq); if so, the whole transaction did, and it is not written twice: a delta is
never repeated.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from llmq import protocol
from llmq.broker.commands import queue_events
from llmq.broker.connection import is_cluster
from llmq.broker.keys import GROUP
from llmq.broker.retry import is_refusal_to_wait_out
from llmq.protocol import Encoding, Event
from llmq.protocol.errors import ProtocolError
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.worker_context import WorkerContext

logger = logging.getLogger(__name__)

# At most this many queued items go into one transaction, so a backlog after an outage is
# written in bounded pieces rather than one huge MULTI.
MAX_ITEMS_PER_BATCH = 256

# The acks of a batch, in the queue's slot, as one script: dead letters added, then XACK of the
# entries still pending under this consumer and their hand-back counts deleted, and the submit
# function's record of those and of entries no longer pending at all; returns the ids a peer
# owns now.
#   KEYS[1] request stream   KEYS[2] hand-back counts   KEYS[3] dead-letter stream
#   KEYS[4] submissions
#   ARGV[1] group   ARGV[2] consumer   ARGV[3] n   ARGV[4 .. 3+n] entry ids
#   then each dead letter: its number of fields k, then k field / value pairs
# NOTE: a plain XACK removes an entry from the PEL whoever owns it: a stalled worker finishing
# late would ack the entry a peer reclaimed and is running as the next attempt, which then could
# never be reclaimed again if that peer died. Its late terminal event (a lower attempt) is
# harmless: readers follow the highest attempt.
ACK_SCRIPT = """
local n = tonumber(ARGV[3])
local i = 4 + n
while i <= #ARGV do
  local k = tonumber(ARGV[i])
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, i + 1, i + 2 * k))
  i = i + 1 + 2 * k
end
local mine, taken, done = {}, {}, {}
for j = 4, 3 + n do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[j], ARGV[j], 1)
  if p[1] then
    if p[1][2] == ARGV[2] then
      mine[#mine + 1] = ARGV[j]
      done[#done + 1] = ARGV[j]
    else
      taken[#taken + 1] = ARGV[j]
    end
  else
    done[#done + 1] = ARGV[j]
  end
end
if #mine > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(mine))
  redis.call('HDEL', KEYS[2], unpack(mine))
end
if #done > 0 then redis.call('HDEL', KEYS[4], unpack(done)) end
return taken
"""
# Lua's unpack has a stack limit in the thousands: ack in slices well below it.
_ACK_SLICE = 500


def ack_script_args(consumer: str, entry_ids: list[str],
                    dead_letters: list[dict[str, bytes]]) -> list[Any]:
    """ACK_SCRIPT's ARGV."""
    args: list[Any] = [GROUP, consumer, len(entry_ids), *entry_ids]
    for fields in dead_letters:
        args.append(len(fields))
        for name, value in fields.items():
            args += [name, value]
    return args


_Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class _Recorder:
    """Stands in for a pipeline: records the commands queued on it, to group them by node."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


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
    events_written: bool = False  # on a cluster: the events are on their nodes, only acks remain

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
        self.submissions_key = ctx.keys.submissions(ctx.queue)
        self.cluster = is_cluster(self.client)
        self._ack_script = self.client.register_script(ACK_SCRIPT)
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
            if ambiguous and self._landed(batch):
                logger.info("a batch of %d events and %d acks was applied before the "
                            "connection broke: not written again", len(batch.events),
                            len(batch.ack_ids))
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

    def write_events(self, pipe: Any, batch: _Batch) -> None:
        """Queue the batch's events: XADD capped, in order, one EXPIRE per result stream."""
        queue_events(pipe, self.ctx.keys, batch.events, result_ttl=self.ctx.config.result_ttl,
                     result_maxlen=self.ctx.config.result_maxlen)

    def _ack_calls(self, batch: _Batch) -> list[tuple[list[str], list[Any]]]:
        """ACK_SCRIPT's (keys, args) for the batch's acks and dead letters, in slices."""
        keys = [self.queue_key, self.handbacks_key, self.dlq_key, self.submissions_key]
        ids = batch.ack_ids
        calls = []
        for start in range(0, max(len(ids), 1), _ACK_SLICE):
            dead_letters = batch.dead_letters if start == 0 else []
            if not ids[start:start + _ACK_SLICE] and not dead_letters:
                break
            calls.append((keys, ack_script_args(self.ctx.worker_id, ids[start:start + _ACK_SLICE],
                                                dead_letters)))
        return calls

    def _execute(self, batch: _Batch) -> None:
        """One server: events and acks in one MULTI, the acks after the events (an OOM-refused
        XADD aborts it whole). A cluster: the events first, pipelined per node, then, once they
        are all on their nodes, the acks in the queue's slot; a retry after the events landed
        sends only the acks, so at-least-once holds without a cross-slot transaction."""
        if self.cluster:
            if batch.events and not batch.events_written:
                self._write_events_per_node(batch)
            batch.events_written = True
            # NOTE: one script call per slice, not pipelined: a cluster pipeline takes no
            # EVALSHA; a slice is up to 500 acks, so there is rarely more than one.
            results = []
            for keys, args in self._ack_calls(batch):
                try:
                    results.append(self._ack_script(keys=keys, args=args))
                except redis.ResponseError as exc:
                    if is_refusal_to_wait_out(exc):
                        raise
                    results.append(exc)
        else:
            pipe = self.client.pipeline(transaction=True)
            self.write_events(pipe, batch)
            calls = self._ack_calls(batch)
            for keys, args in calls:
                self._ack_script(keys=keys, args=args, client=pipe)
            results = pipe.execute(raise_on_error=False)
            self._log_refused(results[:len(results) - len(calls)], raise_transient=False)
            results = results[len(results) - len(calls):]
        for result in results:
            if isinstance(result, Exception):
                logger.warning("XACK failed (%s): entries stay pending", result)
            elif result:
                taken = [protocol.as_str(t) for t in result]
                logger.warning("not acking %d entr%s a peer reclaimed meanwhile: %s",
                               len(taken), "y" if len(taken) == 1 else "ies", taken[:5])

    def _write_events_per_node(self, batch: _Batch) -> None:
        """A cluster's events: one plain pipeline per node, on that node's own connection.

        NOTE: redis-py's cluster pipeline costs several times a plain one in Python (measured
        by bench/broker.py: the writer fell behind at half the single-node rate), so the
        events are grouped by node here; what a node refuses with MOVED or ASK (a slot on the
        move) is sent again, in order, through the cluster client, which follows redirects."""
        recorder = _Recorder()
        self.write_events(recorder, batch)
        by_node: dict[str, tuple[Any, list[_Call]]] = {}
        for call in recorder.calls:
            node = self.client.get_node_from_key(call[1][0])
            by_node.setdefault(node.name, (node, []))[1].append(call)
        redirected: list[_Call] = []
        for node, calls in by_node.values():
            pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
            for name, args, kwargs in calls:
                getattr(pipe, name)(*args, **kwargs)
            try:
                results = pipe.execute(raise_on_error=False)
            except TRANSIENT_ERRORS:
                self.client.nodes_manager.initialize()  # a failover: learn the new map
                raise
            moved = [c for c, r in zip(calls, results, strict=True)
                     if isinstance(r, redis.ResponseError) and str(r).startswith(("MOVED",
                                                                                  "ASK"))]
            redirected += moved
            self._log_refused([r for r in results if not (
                isinstance(r, redis.ResponseError) and str(r).startswith(("MOVED", "ASK")))],
                raise_transient=True)
        if redirected:
            pipe = self.client.pipeline(transaction=False)
            for name, args, kwargs in redirected:
                getattr(pipe, name)(*args, **kwargs)
            self._log_refused(pipe.execute(raise_on_error=False), raise_transient=True)

    @staticmethod
    def _log_refused(results: list[Any], *, raise_transient: bool) -> None:
        for result in results:
            if not isinstance(result, Exception):
                continue
            if raise_transient and is_refusal_to_wait_out(result):
                raise result  # OOM, a failover, a migrating slot: written again with backoff
            # NOTE: a command refused at EXEC time (WRONGTYPE on a key someone else created)
            # will never succeed: log it and go on rather than retry forever.
            logger.error("a result write failed: %s", result)

    def _landed(self, batch: _Batch) -> bool:
        """After an ambiguous failure (EXEC sent, reply lost): whether the transaction ran.
        It is all or nothing, so one witness decides: its acks, else its last event."""
        if batch.ack_ids:
            return self._acks_landed(batch.ack_ids)
        if batch.events:
            return self._event_landed(*batch.events[-1])
        return False

    def _event_landed(self, event: Event, encoding: Encoding) -> bool:
        """Whether `event` is among the last entries of its result stream. A request's events
        are told apart by (type, attempt, seq): a delta written twice would repeat a `seq`."""
        try:
            entries = self.client.xrevrange(self.ctx.keys.result(event.request_id), count=64)
        except (*TRANSIENT_ERRORS, redis.ResponseError):  # type: ignore[misc]
            return False
        key = _identity(event)
        for _, fields in entries:
            try:
                if _identity(protocol.decode_event(fields)) == key:
                    return True
            except ProtocolError:
                continue
        return False

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


def _identity(event: Event) -> tuple[str, int, int]:
    return (type(event).__name__, event.attempt, getattr(event, "seq", -1))


def _figures(terminal: protocol.Done | protocol.Error, output: EngineCoreOutput
             ) -> tuple[str, str | None, protocol.Usage, protocol.Timings]:
    """(finish reason, error code, usage, timings) of a finished request, for the counters."""
    # NOTE: a `done` counts the n completions of a request once (its prompt once).
    if isinstance(terminal, protocol.Done):
        return terminal.finish_reason, None, terminal.usage, terminal.timings
    return ("error", terminal.code, output.usage or protocol.Usage(0, 0, 0),
            output.timings or protocol.Timings(0.0, None, 0.0, None))
