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

import dataclasses
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from llmq.broker import protocol
from llmq.broker.keys import GROUP, Keys
from llmq.worker.backoff import TRANSIENT_ERRORS, Backoff, ConnectionState
from llmq.worker.engine.outputs import EngineCoreOutput, Timings, Usage
from llmq.worker.faults import Faults
from llmq.worker.inflight_table import InFlight, InFlightTable

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
    encoding: str
    events: list[protocol.Event]
    ack: bool = False  # XACK the entry after its events: this write is its last
    dead_letter: dict[str, bytes] | None = None  # fields to XADD to the dead-letter stream
    pop: bool = True  # forget the entry once acked (False for entries never in the table)


@dataclass
class _Batch:
    commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    result_keys: set[str] = field(default_factory=set)
    ack_ids: list[str] = field(default_factory=list)
    pop_ids: list[str] = field(default_factory=list)  # forgotten after the write
    finished: list[EngineCoreOutput] = field(default_factory=list)  # for metrics
    errors: list[str] = field(default_factory=list)  # codes of admission errors, for metrics
    num_dead_letters: int = 0


class ResultWriter:
    def __init__(self, client: redis.Redis, keys: Keys, queue_name: str, worker_id: str,
                 table: InFlightTable, *, result_ttl: int, result_maxlen: int,
                 state: ConnectionState, faults: Faults, metrics: Any = None) -> None:
        self.client = client
        self.keys = keys
        self.queue_key = keys.queue(queue_name)
        self.handbacks_key = keys.handbacks(queue_name)
        self._ack_owned = client.register_script(_ACK_OWNED)
        self.dlq_key = keys.dlq(queue_name)
        self.worker_id = worker_id
        self.table = table
        self.result_ttl = result_ttl
        self.result_maxlen = result_maxlen
        self.faults = faults
        self.metrics = metrics
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._give_up_at: float | None = None
        self.backoff = Backoff("result writer", state, stop=None)
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
            if batch.commands or batch.ack_ids:
                self._write(batch)
            self._after_write(batch)
        logger.debug("result writer stopped")

    def _add_entry_write(self, batch: _Batch, write: EntryWrite) -> None:
        if write.dead_letter is not None:
            batch.commands.append(("xadd", (self.dlq_key, write.dead_letter), {}))
            batch.num_dead_letters += 1
        if write.request_id is not None:
            key = self.keys.result(write.request_id)
            for event in write.events:
                self._xadd_event(batch, key, event, write.encoding)
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
            if output.finished:
                entry.finished_choices[output.index] = output
                if len(entry.finished_choices) >= entry.n:
                    self.table.pop(entry.entry_id)
            return
        key = self.keys.result(entry.request_id)
        if entry.stream and (output.new_token_ids or output.new_text):
            delta = protocol.Delta(
                request_id=entry.request_id, attempt=entry.attempt, seq=entry.seq,
                text=output.new_text, token_ids=list(output.new_token_ids),
                logprobs=_logprobs(output) if output.new_logprobs else None,
                index=output.index)
            entry.seq += 1
            self._xadd_event(batch, key, delta, entry.encoding)
        if not output.finished:
            return
        choices = None
        if entry.n > 1:
            # NOTE: one terminal event per attempt, once every completion has finished.
            entry.finished_choices[output.index] = output
            if len(entry.finished_choices) < entry.n:
                return
            choices = [entry.finished_choices[i] for i in range(entry.n)]
            output = combine_choices(choices)
        entry.terminal = True
        self._xadd_event(batch, key, terminal_event(entry, output, choices), entry.encoding)
        batch.ack_ids.append(entry.entry_id)
        batch.pop_ids.append(entry.entry_id)
        batch.finished.append(output)

    def _xadd_event(self, batch: _Batch, key: str, event: protocol.Event, encoding: str) -> None:
        fields = protocol.encode_event(event, encoding)  # type: ignore[arg-type]
        batch.commands.append(
            ("xadd", (key, fields), {"maxlen": self.result_maxlen, "approximate": True}))
        batch.result_keys.add(key)

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
                    self.num_abandoned += len(batch.commands)
                    logger.error("shutting down with Redis unreachable: %d events and %d acks "
                                 "not written (their entries stay pending and are reclaimed)",
                                 len(batch.commands), len(batch.ack_ids))
                    batch.pop_ids.clear()
                    batch.finished.clear()
                    return
                self.backoff.failed(e)

    def _execute(self, batch: _Batch) -> None:
        pipe = self.client.pipeline(transaction=True)
        for name, args, kwargs in batch.commands:
            getattr(pipe, name)(*args, **kwargs)
        for key in batch.result_keys:
            pipe.expire(key, self.result_ttl)
        crash = self.faults.crash_after_terminal and bool(batch.ack_ids)
        if batch.ack_ids and not crash:
            pipe.hdel(self.handbacks_key, *batch.ack_ids)
            self._ack_owned(keys=[self.queue_key],
                            args=[GROUP, self.worker_id, *batch.ack_ids], client=pipe)
        results = pipe.execute(raise_on_error=False)
        if crash:
            logger.error("TEST-ONLY fault crash_after_terminal: exiting before XACK")
            os._exit(9)
        for (name, args, _), result in zip(batch.commands, results, strict=False):
            if isinstance(result, Exception):
                # NOTE: a command refused at EXEC time (WRONGTYPE on a key someone else created)
                # will never succeed: log it and go on rather than retry forever.
                logger.error("%s %s failed: %s", name, args[0], result)
        if batch.ack_ids and isinstance(results[-1], Exception):
            logger.warning("XACK failed (%s): entries stay pending", results[-1])
        elif batch.ack_ids and results[-1]:
            taken = [t.decode() if isinstance(t, bytes) else t for t in results[-1]]
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
        if self.metrics is None:
            return
        for output in batch.finished:
            usage, t = output.usage, output.timings
            self.metrics.observe_finished(
                output.finish_reason, output.error_code,
                usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0,
                usage.cached_prompt_tokens if usage else 0,
                _nonneg(t.queue) if t else None, _nonneg(t.ttft) if t else None,
                _nonneg(t.e2e) or 0.0 if t else 0.0, _nonneg(t.per_token) if t else None)
        for code in batch.errors:
            self.metrics.observe_finished("error", code, 0, 0, 0, None, None, 0.0, None)
        if batch.num_dead_letters:
            self.metrics.inc_dead_letters(batch.num_dead_letters)


def combine_choices(choices: list[EngineCoreOutput]) -> EngineCoreOutput:
    """The n finished completions of one request as one output: choice 0's text, the first
    failure if any failed, the prompt counted once, and the spans of the whole request."""
    first = next((c for c in choices if c.finish_reason == "error"), choices[0])
    usages = [c.usage for c in choices if c.usage is not None]
    usage = Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages),
                  usages[0].cached_prompt_tokens) if usages else None
    spans = [c.timings for c in choices if c.timings is not None]
    timings = None
    if spans:
        gaps = [t.per_token for t in spans if t.per_token]
        timings = Timings(queue=min(t.queue for t in spans), ttft=min(t.ttft for t in spans),
                          e2e=max(t.e2e for t in spans),
                          per_token=sum(gaps) / len(gaps) if gaps else 0.0)
    return dataclasses.replace(first, usage=usage, timings=timings)


def terminal_event(entry: InFlight, output: EngineCoreOutput,
                   choices: list[EngineCoreOutput] | None = None) -> protocol.Event:
    """The `done` or `error` event closing an attempt; with n > 1, `output` is
    `combine_choices(choices)` and the `done` event lists every choice."""
    if output.finish_reason == "error":
        return protocol.Error(
            request_id=entry.request_id, attempt=entry.attempt,
            code=output.error_code or protocol.ErrorCode.ENGINE_ERROR.value,
            message=output.error_message or "the engine failed this request",
            metadata=entry.metadata)
    usage = output.usage
    timings = output.timings
    return protocol.Done(
        request_id=entry.request_id, attempt=entry.attempt,
        finish_reason=output.finish_reason,  # type: ignore[arg-type]
        text=output.text or "",
        usage=protocol.Usage(usage.prompt_tokens, usage.completion_tokens,
                             usage.cached_prompt_tokens) if usage else protocol.Usage(0, 0, 0),
        timings=protocol.Timings(
            queue=max(0.0, timings.queue), ttft=_nonneg(timings.ttft), e2e=max(0.0, timings.e2e),
            per_token=_nonneg(timings.per_token)) if timings else protocol.Timings(0.0, None, 0.0,
                                                                                   None),
        stop_reason=output.stop_reason, metadata=entry.metadata,
        choices=[protocol.Choice(
            index=c.index, text=c.text or "", finish_reason=c.finish_reason,  # type: ignore[arg-type]
            completion_tokens=c.usage.completion_tokens if c.usage else 0,
            stop_reason=c.stop_reason) for c in choices] if choices else None)


def _nonneg(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else max(0.0, value)


def _finite(value: float) -> float | None:
    # JSON cannot carry -inf / NaN: the protocol spells them None.
    return value if math.isfinite(value) else None


def _logprobs(output: EngineCoreOutput) -> list[protocol.TokenLogprob]:
    return [protocol.TokenLogprob(token_id=lp.token_id, logprob=_finite(lp.logprob),
                                  top_token_ids=list(lp.top_token_ids),
                                  top_logprobs=[_finite(x) for x in lp.top_logprobs])
            for lp in output.new_logprobs]
