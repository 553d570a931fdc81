"""OrderedRun: a file of requests through the queue, its results handed on in input order.

The one runner behind `llmq submit -f` (broker/file_job.py) and OpenAI-format batches
(gateway/batch_job.py, for `llmq batch` and the gateway's Batch API); each of those is an
adapter (a `RunSink`) that says what a line's record is and where records go.

    run = OrderedRun(client, lines, sink, max_in_flight=1024)
    end = run.run()          # COMPLETED, CANCELLED (sink.stop_requested) or TIMED_OUT

`lines` are in input order, each a request to `Submit` or a record already `Settled` (a line
that failed validation, a result an earlier run wrote): a list, or any iterable, taken from only
as the window opens (a dataset job renders its rows as they are needed), and at most
`max_unwritten` lines ahead of the last record written (None: no bound), so a long input runs
in bounded memory with no pause between parts of it. Requests are submitted in pipelined chunks,
keeping at most `max_in_flight` unfinished at a time (None: all at once), and followed together
(`Client.follow_many`: one reader for all of them). As each request ends, in whatever order, the
sink makes its record (`finished`); records go to `sink.write` strictly in input order, each as
soon as every line before it has one, so a run stopped half way has written a prefix. Request
ids are the caller's, so a rerun or an rq retry queues nothing twice (the broker's submit is
idempotent).

A bounded window is refilled once an eighth of it is free (`_REFILL_FRACTION`), not after each
request that ends: every submission makes the reader subscribe new streams, wake its blocked
read (`CLIENT UNBLOCK`) and send it again with every key it follows, a cost of the window's size;
refilling a request at a time paid it per request (bench/dataset_job.py: the CLI's CPU per row
half as much again as `llmq submit -f`'s, and on a starved CPU the pool waited for it).

Follow-ups (the pipelines of llmq.jobs): `finished` may return a `Submit` instead of a record:
the line goes on with that request (its next stage), queued ahead of new lines within the
window, and its record comes when that one ends. A `Submit` may name its own queue.

Stopping: when `sink.stop_requested()` turns true, no more is submitted, every unfinished
request is cancelled, their answers are awaited for `cancel_grace` s, and the lines left get
`sink.not_run` records. At `timeout` the run just stops: the requests keep running, and a rerun
with the same ids picks them up.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from llmq.broker.client import Client
from llmq.broker.result_reader import FollowerGroup
from llmq.broker.transcript import Transcript
from llmq.broker.work_lanes import BATCH

__all__ = ["OrderedRun", "RunEnd", "RunSink", "Settled", "Submit"]

R = TypeVar("R")

_SUBMIT_CHUNK = 1000  # requests per pipelined round trip
_POLL_MS = 250
_REFILL_FRACTION = 8  # a bounded window is refilled once this fraction of it is free
CANCEL_GRACE = 3.0  # s to wait for cancelled requests' final events


@dataclass(frozen=True)
class Submit:
    """A line to run: its request (wire field names, `id` included) and that id."""

    request_id: str
    body: Mapping[str, Any]
    queue: str | None = None  # None: the client's queue


@dataclass(frozen=True)
class Settled(Generic[R]):
    """A line whose record is known without running it."""

    record: R


class RunEnd(enum.Enum):
    COMPLETED = "completed"  # every line has its record
    CANCELLED = "cancelled"  # stop requested: every line has its record, some `not_run`
    TIMED_OUT = "timed_out"  # the records of a prefix were written; requests keep running


class RunSink(Protocol[R]):
    """What an adapter supplies to an `OrderedRun`."""

    def finished(self, index: int, transcript: Transcript) -> R | Submit:
        """The record of line `index`, whose request ended (any order, as they end); or a
        follow-up request that line goes on with."""

    def not_run(self, index: int, *, submitted: bool) -> R:
        """The record of line `index` a stop left without a result (`submitted`: it was
        queued and cancelled; else it was never queued)."""

    def write(self, record: R) -> None:
        """The next record in input order."""

    def tick(self, submitted: int) -> None:
        """Called between rounds (about every 250 ms): `submitted` requests queued so far."""

    def stop_requested(self) -> bool:
        """Whether to stop: cancel what runs, record the rest as not run."""


class OrderedRun(Generic[R]):
    def __init__(self, client: Client, lines: Iterable[Submit | Settled[R]], sink: RunSink[R],
                 *, max_in_flight: int | None = None, max_unwritten: int | None = None,
                 timeout: float | None = None, cancel_grace: float = CANCEL_GRACE) -> None:
        for name, value in (("max_in_flight", max_in_flight), ("max_unwritten", max_unwritten)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}")
        self.client = client
        self.sink = sink
        self.max_in_flight = max_in_flight
        self.max_unwritten = max_unwritten
        self.timeout = timeout
        self.cancel_grace = cancel_grace
        self.written = 0  # lines whose records went to the sink, in input order
        self.unfinished = 0  # after a timeout: requests still queued or running
        self._lines = enumerate(lines)
        self._num_taken = 0  # lines taken from `lines`
        self._exhausted = False  # every line taken
        self._ready: dict[int, R] = {}  # records not yet written, by line index
        self._queued: deque[tuple[int, Submit]] = deque()  # lines taken, not yet submitted
        self._submitted = 0  # lines whose first request was submitted
        self._index_of: dict[str, int] = {}  # request id -> line index, while it runs
        self._follow_ups: deque[tuple[int, Submit]] = deque()  # (line index, request) to submit
        self._refill = (1 if max_in_flight is None
                        else max(1, max_in_flight // _REFILL_FRACTION))

    def run(self) -> RunEnd:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        gatherer = self.client.follow_many()
        try:
            while True:
                self._flush()
                if self.sink.stop_requested():
                    self._stop(gatherer)
                    return RunEnd.CANCELLED
                self._submit_some(gatherer)
                if (not gatherer and not self._follow_ups and not self._queued
                        and self._exhausted):
                    self._flush()
                    return RunEnd.COMPLETED
                if deadline is not None and time.monotonic() > deadline:
                    self.unfinished = len(gatherer)
                    return RunEnd.TIMED_OUT
                self._gather(gatherer)
                self.sink.tick(self._submitted)
        finally:
            gatherer.close()

    def _take(self, wanted: int) -> None:
        """Take lines until `wanted` requests wait to be submitted, the input ends, or the
        lines taken run `max_unwritten` ahead of the output; settled lines go to `_ready`."""
        while (len(self._queued) < wanted and not self._exhausted
               and (self.max_unwritten is None
                    or self._num_taken - self.written < self.max_unwritten)):
            taken = next(self._lines, None)
            if taken is None:
                self._exhausted = True
                return
            self._num_taken += 1
            index, line = taken
            if isinstance(line, Settled):
                self._ready[index] = line.record
            else:
                self._queued.append((index, line))

    def _submit_some(self, gatherer: FollowerGroup) -> None:
        """Submit while the window has room: follow-ups first, so started lines finish first."""
        while True:
            room = (_SUBMIT_CHUNK if self.max_in_flight is None
                    else min(_SUBMIT_CHUNK, self.max_in_flight - len(gatherer)))
            self._take(max(room, self._refill) - len(self._follow_ups))
            self._flush()  # settled lines taken just now
            waiting = len(self._follow_ups) + len(self._queued)
            # NOTE: with nothing in flight any room will do (the last few, a tiny window).
            if waiting == 0 or room <= 0 or (room < min(self._refill, waiting) and gatherer):
                return
            chunk = [self._follow_ups.popleft() for _ in range(min(room,
                                                                   len(self._follow_ups)))]
            while len(chunk) < room and self._queued:
                chunk.append(self._queued.popleft())
                self._submitted += 1
            # NOTE: one round trip per run of requests to the same queue (a pipeline's stages
            # may each have their own).
            for queue, run in itertools.groupby(chunk, key=lambda item: item[1].queue):
                same_queue = list(run)
                # NOTE: every run is batch work (the Batch API, `llmq batch`, `llmq submit -f`,
                # `llmq run`): its lane (broker/work_lanes.py), unless a line names its own.
                request_ids = self.client.submit_many(
                    [{"lane": BATCH, **s.body} for _, s in same_queue], queue=queue)
                gatherer.add(request_ids)
                self._index_of.update(zip(request_ids, [i for i, _ in same_queue],
                                          strict=True))
            self.sink.tick(self._submitted)

    def _gather(self, gatherer: FollowerGroup) -> None:
        for transcript in gatherer.poll(block_ms=_POLL_MS):
            index = self._index_of.pop(transcript.request_id)
            outcome = self.sink.finished(index, transcript)
            if isinstance(outcome, Submit):
                self._follow_ups.append((index, outcome))
            else:
                self._ready[index] = outcome

    def _flush(self) -> None:
        while self.written in self._ready:
            self.sink.write(self._ready.pop(self.written))
            self.written += 1

    def _stop(self, gatherer: FollowerGroup) -> None:
        for request_id in gatherer.pending_ids():
            self.client.cancel(request_id)
        deadline = time.monotonic() + self.cancel_grace
        while gatherer and time.monotonic() < deadline:
            self._gather(gatherer)
        for request_id in gatherer.pending_ids():
            index = self._index_of[request_id]
            self._ready[index] = self.sink.not_run(index, submitted=True)
        for index, _ in self._follow_ups:
            self._ready[index] = self.sink.not_run(index, submitted=False)
        for index, _ in self._queued:
            self._ready[index] = self.sink.not_run(index, submitted=False)
        for index, line in self._lines:  # the lines not taken yet
            self._ready[index] = (line.record if isinstance(line, Settled)
                                  else self.sink.not_run(index, submitted=False))
        self._flush()
