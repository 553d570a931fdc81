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

What one transaction holds is a `ResultBatch` (worker/result_batch.py); the acks go through
the library's `llmq_ack` (worker/ack_script.py), and a cluster's events through one pipeline per
node (worker/cluster_pipelines.py). When the server lacks the library (flushed, or a restart
without persistence), the events stay written and only the acks are retried, with backoff, once
the library is back (loaded again by this worker if its user may, else by the admin).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis
from redis.cluster import RedisCluster

from llmq import protocol
from llmq.broker.commands import queue_events
from llmq.broker.functions import is_missing_function, reload_missing
from llmq.broker.keys import GROUP
from llmq.broker.retry import is_refusal_to_wait_out
from llmq.broker.work_lanes import WorkLane
from llmq.protocol import Encoding, Event
from llmq.protocol.errors import ProtocolError
from llmq.worker.ack_script import ack_calls, ack_fcall_args
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff
from llmq.worker.cluster_pipelines import CommandRecorder, send_per_node
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.result_batch import EntryWrite, ResultBatch
from llmq.worker.worker_context import WorkerContext

# EntryWrite is what `put` takes: importable from here, where its callers look for it.
__all__ = ["MAX_ITEMS_PER_BATCH", "EntryWrite", "ResultWriter"]

logger = logging.getLogger(__name__)

# At most this many queued items go into one transaction, so a backlog after an outage is
# written in bounded pieces rather than one huge MULTI.
MAX_ITEMS_PER_BATCH = 256


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
        # NOTE: a `redis+cluster://` URL gives the worker RedisCluster connections.
        self.cluster_client = self.client if isinstance(self.client, RedisCluster) else None
        self.cluster = self.cluster_client is not None
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
            batch = ResultBatch()
            for item in items:
                if isinstance(item, EntryWrite):
                    batch.add_entry_write(item)
                else:
                    for output in item:
                        batch.add_output(output, self.table)
            if batch.num_writes or batch.ack_ids:
                write_started_ns = time.time_ns()
                self._write(batch)
                if self.ctx.spans is not None and (batch.finished or batch.answered):
                    self.ctx.spans.finished(batch.finished, self.table, write_started_ns)
                    self.ctx.spans.answered(batch.answered, self.table, write_started_ns)
            self._after_write(batch)
        logger.debug("result writer stopped")

    # -- writing ----------------------------------------------------------------------------------

    def _write(self, batch: ResultBatch) -> None:
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

    def write_events(self, pipe: Any, batch: ResultBatch) -> None:
        """Queue the batch's events: XADD capped, in order, one EXPIRE per result stream."""
        queue_events(pipe, self.ctx.keys, batch.events, result_ttl=self.ctx.config.result_ttl,
                     result_maxlen=self.ctx.config.result_maxlen)

    def _ack_calls(self, batch: ResultBatch) -> list[tuple[list[str], list[Any]]]:
        """The ack script's calls, one set per lane stream the acked entries are on (the dead
        letters go with the first)."""
        calls = []
        letters = batch.dead_letters
        for lane, ids in self._by_lane(batch).items():
            keys = [lane.stream, self.handbacks_key, self.dlq_key, lane.submissions]
            calls += ack_calls(keys, self.ctx.worker_id, ids, letters)
            letters = []
        if letters:  # dead letters without an ack
            calls += ack_calls([self.queue_key, self.handbacks_key, self.dlq_key,
                                self.submissions_key], self.ctx.worker_id, [], letters)
        return calls

    def _by_lane(self, batch: ResultBatch) -> dict[WorkLane, list[str]]:
        """The batch's acked entry ids by lane: the write's, else the in-flight table's, else
        the queue's own stream."""
        held = self.table.lanes_of(batch.ack_ids)
        by_lane: dict[WorkLane, list[str]] = {}
        for entry_id in batch.ack_ids:
            lane = batch.lanes.get(entry_id) or held.get(entry_id) or self.ctx.lanes.queue_lane
            by_lane.setdefault(lane, []).append(entry_id)
        return by_lane

    def _execute(self, batch: ResultBatch) -> None:
        """One server: events and acks in one MULTI, the acks after the events (an OOM-refused
        XADD aborts it whole). A cluster: the events first, pipelined per node, then, once they
        are all on their nodes, the acks in the queue's slot; a retry after the events landed
        sends only the acks, so at-least-once holds without a cross-slot transaction."""
        if self.cluster_client is not None:
            if batch.events and not batch.events_written:
                self._write_events_per_node(self.cluster_client, batch)
            batch.events_written = True
            # NOTE: one function call per slice, not pipelined: a slice is up to 500 acks, so
            # there is rarely more than one.
            results = []
            for keys, args in self._ack_calls(batch):
                try:
                    results.append(self.client.fcall(*ack_fcall_args(keys, args)))
                except redis.ResponseError as exc:
                    if is_refusal_to_wait_out(exc):
                        raise
                    results.append(exc)
        else:
            pipe = self.client.pipeline(transaction=True)
            if not batch.events_written:
                self.write_events(pipe, batch)
            calls = self._ack_calls(batch)
            for keys, args in calls:
                pipe.fcall(*ack_fcall_args(keys, args))
            results = pipe.execute(raise_on_error=False)
            self._log_refused(results[:len(results) - len(calls)], raise_transient=False)
            results = results[len(results) - len(calls):]
            batch.events_written = True
        if any(isinstance(r, Exception) and is_missing_function(r) for r in results):
            # NOTE: FCALL of a missing function fails at EXEC, after the events: they are
            # written; the retry sends only the acks (raised: written again with backoff).
            raise reload_missing(self.client)
        for result in results:
            if isinstance(result, Exception):
                logger.warning("XACK failed (%s): entries stay pending", result)
            elif result:
                taken = [protocol.as_str(t) for t in result]
                logger.warning("not acking %d entr%s a peer reclaimed meanwhile: %s",
                               len(taken), "y" if len(taken) == 1 else "ies", taken[:5])

    def _write_events_per_node(self, client: RedisCluster, batch: ResultBatch) -> None:
        """A cluster's events: one plain pipeline per node (worker/cluster_pipelines.py says
        why); a refusal to wait out raises, to be written again with backoff."""
        recorder = CommandRecorder()
        self.write_events(recorder, batch)
        send_per_node(client, recorder.calls,
                      lambda results: self._log_refused(results, raise_transient=True))

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

    def _landed(self, batch: ResultBatch) -> bool:
        """After an ambiguous failure (EXEC sent, reply lost): whether the transaction ran.
        It is all or nothing, so one witness decides: its acks, else its last event."""
        if batch.ack_ids:
            return self._acks_landed(batch.ack_ids, batch.lanes)
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
        for _, fields in entries or []:
            if not fields:
                continue
            try:
                if _identity(protocol.decode_event(fields)) == key:
                    return True
            except ProtocolError:
                continue
        return False

    def _acks_landed(self, ack_ids: list[str], lanes: dict[str, WorkLane]) -> bool:
        """After an ambiguous failure: True when every acked entry is still in the stream but no
        longer pending, i.e. the transaction ran. When the entries are gone altogether (Redis
        came back without its data) nothing can be known: write again, a duplicate beats a loss.
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            held = self.table.lanes_of(ack_ids)
            for entry_id in ack_ids:
                lane = lanes.get(entry_id) or held.get(entry_id)
                stream = lane.stream if lane is not None else self.queue_key
                pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
                pipe.xrange(stream, min=entry_id, max=entry_id, count=1)
            results = pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS:
            return False
        if any(isinstance(r, Exception) for r in results):
            return False  # NOGROUP: the group is gone, so write the events again to be sure
        pending, present = results[0::2], results[1::2]
        return all(not p for p in pending) and all(present)

    def _after_write(self, batch: ResultBatch) -> None:
        for entry_id in batch.pop_ids:
            self.table.pop(entry_id)
        finished = batch.finished_figures()
        if finished or batch.errors:
            self.ctx.counters.add_finished([(r, u, t) for r, _, u, t in finished],
                                           len(batch.errors))
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

