"""EventPrinter: one request's events as a person (streamed text) or a script (--json) wants them.

Shared by `llmq submit` and `llmq result`. It follows the attempt rule of `Transcript`: when a
newer attempt starts (a worker died and a peer re-runs the request), the text shown so far is
superseded, so the printer ends the line, says so on stderr, and shows the new attempt's text.
With n > 1, choice 0 streams and the others follow it, each under a `--- choice i ---` line.
For scripts that must never see a superseded fragment, `--no-stream` prints only the final text
and `--json` prints every event (each carries its `attempt`).
"""

from __future__ import annotations

import sys
from typing import TextIO

import click

from llmq.broker.client import Client
from llmq.cli.helpers import note, to_json
from llmq.protocol import Delta, Done, Error, Event, Start
from llmq.protocol.errors import RequestFailed


class EventPrinter:
    def __init__(self, *, json_lines: bool = False, stream: bool = True,
                 out: TextIO | None = None) -> None:
        self.json_lines = json_lines
        self.stream = stream
        self.out = out if out is not None else sys.stdout
        self.attempt = 0
        self.shown = ""  # text of the current attempt already written

    def follow(self, client: Client, request_id: str, timeout: float | None = None) -> Done:
        """Print events until the terminal one; RequestFailed for an error event."""
        final: Done | Error | None = None
        for event in client.events(request_id, timeout=timeout):
            self.show(event)
            if isinstance(event, Done | Error):
                final = event
        assert final is not None, "events() ends only after a terminal event"
        if isinstance(final, Error):
            raise RequestFailed(final)
        return final

    def show(self, event: Event) -> None:
        if event.attempt > self.attempt:
            if self.attempt and not self.json_lines:
                self._restart(event)
            self.attempt, self.shown = event.attempt, ""
        if self.json_lines:
            self._write(to_json(event) + "\n")
        elif isinstance(event, Delta) and self.stream and event.index == 0:
            self._write(event.text)
            self.shown += event.text
        elif isinstance(event, Done):
            self._finish(event)
        elif isinstance(event, Error) and self.shown:
            self._write("\n")

    def _restart(self, event: Event) -> None:
        if self.shown:
            self._write("\n")
        who = f" on worker {event.worker}" if isinstance(event, Start) else ""
        note(f"attempt {event.attempt} started{who} (the previous worker stopped): "
             "the text above is superseded")

    def _finish(self, done: Done) -> None:
        # NOTE: `done.text` is authoritative; deltas may have been trimmed (MAXLEN) before we read
        # them, so print whatever the streamed text is missing rather than trusting it.
        if done.text.startswith(self.shown):
            self._write(done.text[len(self.shown):])
        else:
            self._write("\n")
            note("some streamed tokens were missed; the full answer follows")
            self._write(done.text)
        self._write("\n" + _other_choices(done))
        if done.finish_reason == "cancelled":
            note(f"request {done.request_id} was cancelled")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def echo_final(final: Done, json_lines: bool) -> None:
    """A finished request's answer, for `llmq result` without --follow."""
    click.echo(to_json(final) if json_lines else final.text + "\n" + _other_choices(final),
               nl=json_lines)


def _other_choices(done: Done) -> str:
    """Choices 1..n-1 of a request with n > 1, each under a line naming it (choice 0 streams
    as the answer)."""
    return "".join(f"--- choice {c.index} ---\n{c.text}\n" for c in done.choices or ()
                   if c.index != 0)
