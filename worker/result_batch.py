"""ResultBatch: what the result writer puts in one transaction, gathered from its queue.

The writer's queue holds two kinds of items: a step's `EngineCoreOutput`s from the busy loop,
and `EntryWrite`s (events for one entry from outside the engine: admission's `start` and
errors, the reclaimer's dead letters). `ResultBatch` turns them into what one write needs, in
queue order: the events (a step's deltas numbered by `seq`, one terminal event per attempt once
all n completions finished), the dead letters, the entries to ack and to forget, and what the
metrics count once the write is done (worker/result_writer.py writes it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmq import protocol
from llmq.protocol import Encoding, Event
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.inflight_table import InFlightTable

__all__ = ["EntryWrite", "FinishedFigures", "ResultBatch"]

logger = logging.getLogger(__name__)

# (finish reason, error code, usage, timings) of a finished request, for the counters
FinishedFigures = tuple[str, str | None, protocol.Usage, protocol.Timings]


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
class ResultBatch:
    events: list[tuple[Event, Encoding]] = field(default_factory=list)  # in order
    dead_letters: list[dict[str, bytes]] = field(default_factory=list)
    ack_ids: list[str] = field(default_factory=list)
    pop_ids: list[str] = field(default_factory=list)  # forgotten after the write
    # For metrics: each finished request's terminal event, with the output that ended it.
    finished: list[tuple[protocol.Done | protocol.Error, EngineCoreOutput]] = field(
        default_factory=list)
    errors: list[str] = field(default_factory=list)  # codes of admission errors, for metrics
    events_written: bool = False  # the events are on their nodes: only acks remain to send

    @property
    def num_writes(self) -> int:
        return len(self.events) + len(self.dead_letters)

    def add_entry_write(self, write: EntryWrite) -> None:
        if write.dead_letter is not None:
            self.dead_letters.append(write.dead_letter)
        if write.request_id is not None:
            for event in write.events:
                self.events.append((event, write.encoding))
                if isinstance(event, protocol.Error):
                    self.errors.append(event.code)
        if write.ack:
            self.ack_ids.append(write.entry_id)
            if write.pop:
                self.pop_ids.append(write.entry_id)

    def add_output(self, output: EngineCoreOutput, table: InFlightTable) -> None:
        """One engine output of the entry `table` holds for it: its delta (numbered by the
        entry's `seq`), and, once every completion finished, the attempt's terminal event and
        the entry's ack."""
        entry = table.get(output.request_id)
        if entry is None:
            logger.warning("output for unknown entry %s dropped", output.request_id)
            return
        if entry.fenced:
            # A peer owns the entry now (lease lost): write nothing more, and forget it once the
            # engine has let go of it. Never ack: the peer's attempt will.
            if output.finished and protocol.gather_choices(entry.finished_choices, output,
                                                           entry.n) is not None:
                table.pop(entry.entry_id)
            return
        if entry.stream and (output.new_token_ids or output.new_text):
            delta = protocol.Delta(
                request_id=entry.request_id, attempt=entry.attempt, seq=entry.seq,
                text=output.new_text, token_ids=list(output.new_token_ids),
                logprobs=output.new_logprobs or None, index=output.index)
            entry.seq += 1
            self.events.append((delta, entry.encoding))
        if not output.finished:
            return
        # NOTE: one terminal event per attempt, once every one of the n completions finished.
        outputs = protocol.gather_choices(entry.finished_choices, output, entry.n)
        if outputs is None:
            return
        entry.terminal = True
        terminal = protocol.terminal_event(entry.request_id, entry.attempt, outputs,
                                           entry.metadata)
        self.events.append((terminal, entry.encoding))
        self.ack_ids.append(entry.entry_id)
        self.pop_ids.append(entry.entry_id)
        self.finished.append((terminal, output))

    def finished_figures(self) -> list[FinishedFigures]:
        """(finish reason, error code, usage, timings) of each request the batch finished."""
        return [_figures(terminal, output) for terminal, output in self.finished]


def _figures(terminal: protocol.Done | protocol.Error, output: EngineCoreOutput
             ) -> FinishedFigures:
    # NOTE: a `done` counts the n completions of a request once (its prompt once).
    if isinstance(terminal, protocol.Done):
        return terminal.finish_reason, None, terminal.usage, terminal.timings
    return ("error", terminal.code, output.usage or protocol.Usage(0, 0, 0),
            output.timings or protocol.Timings(0.0, None, 0.0, None))
