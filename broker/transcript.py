"""Transcript: one request's events folded into its text by the attempt rule.

A request may run more than once (at-least-once delivery: a worker died, or its lease lapsed and a
peer re-ran it). Every event carries the `attempt` that wrote it, and the rule readers follow is:

1. the current attempt is the highest one seen; events of lower attempts are ignored;
2. when the attempt rises, the text assembled so far is dropped (the new attempt starts over);
3. the first terminal event (`done` or `error`) of the current attempt ends the request; `done.text`
   is the whole output.

Deltas are numbered `seq` 0, 1, 2... within an attempt; a jump means entries were trimmed away
(MAXLEN) before this reader saw them, flagged as `truncated` (the `done` text is still complete).
"""

from __future__ import annotations

import enum

from llmq.protocol import Delta, Done, Error, Event, Start

__all__ = ["Fold", "Transcript"]


class Fold(enum.Enum):
    IGNORED = "ignored"  # superseded attempt, duplicate delta, or after the end: not for the reader
    ACCEPTED = "accepted"
    RESTARTED = "restarted"  # accepted, and it began a newer attempt: drop the text shown so far


class Transcript:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.attempt = 0  # 0: no event seen yet
        self.text = ""  # the current attempt's text so far (the whole output once finished)
        self.start: Start | None = None  # the current attempt's start event
        self.final: Done | Error | None = None  # the terminal event, once the request has ended
        self.truncated = False  # a delta of the current attempt was never seen
        self.num_restarts = 0
        self._next_seq = 0

    @property
    def finished(self) -> bool:
        return self.final is not None

    def apply(self, event: Event) -> Fold:
        """Fold one event in; IGNORED events should not be shown to the reader."""
        if self.final is not None or event.attempt < self.attempt:
            return Fold.IGNORED
        fold = Fold.ACCEPTED
        if event.attempt > self.attempt:
            if self.attempt:
                fold = Fold.RESTARTED
                self.num_restarts += 1
            self.attempt = event.attempt
            self.text, self.start, self.truncated, self._next_seq = "", None, False, 0
        if isinstance(event, Start):
            self.start = event
        elif isinstance(event, Delta):
            if event.seq < self._next_seq:
                return Fold.IGNORED  # already applied (a re-read entry)
            self.truncated |= event.seq > self._next_seq
            self._next_seq = event.seq + 1
            self.text += event.text
        else:
            self.final = event
            if isinstance(event, Done):
                self.text = event.text  # authoritative, even when deltas were trimmed away
        return fold
