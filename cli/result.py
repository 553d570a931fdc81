"""`llmq result` and `llmq cancel`: one request by id, after it was submitted.

A request id is known while its result stream exists (until `result_ttl` after its last event),
or while it waits in its queue: an id given at submit has an idempotency marker, and an id that
is the stream entry id is found in the queue stream itself.
"""

from __future__ import annotations

from typing import Any

import click

from llmq.broker.client import Client
from llmq.broker.exchange import send
from llmq.broker.request_lookup import RequestLookup
from llmq.broker.transcript import Transcript
from llmq.cli.event_printer import EventPrinter
from llmq.cli.helpers import note, open_client
from llmq.cli.options import connection_kwargs, connection_options
from llmq.protocol import Done, Error, Event
from llmq.protocol.errors import LLMQError, RequestFailed, ResultTimeout


def read_transcript(client: Client, request_id: str) -> tuple[Transcript, list[Event]]:
    """The request's events so far (superseded attempts dropped) and their fold."""
    return send(client, RequestLookup(client.keys).events(request_id))


def is_queued(client: Client, request_id: str, queue: str | None = None) -> bool:
    """Whether the request waits in its queue (it has no events yet)."""
    queue = queue or client.settings.queue
    lookup = RequestLookup(client.keys)
    if send(client, lookup.marked(queue, request_id)):
        return True
    in_queue = lookup.in_queue(queue, request_id)
    return in_queue is not None and send(client, in_queue)


def unknown_request(client: Client, request_id: str) -> LLMQError:
    return LLMQError(
        f"unknown request {request_id}: it has no result stream and is not waiting in queue "
        f"{client.settings.queue!r} (results expire a while after they finish; check --queue "
        "and --prefix)")


@click.command()
@click.argument("request_id")
@click.option("--follow", "-F", is_flag=True, help="Stream the events until the request ends.")
@click.option("--json", "json_lines", is_flag=True, help="Print every event as one JSON line.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --follow: give up after this many seconds.")
@connection_options
def result(request_id: str, follow: bool, json_lines: bool, timeout: float | None,
           **kwargs: Any) -> None:
    """Show the answer of REQUEST_ID (what has arrived so far, or all of it with --follow)."""
    client = open_client(**connection_kwargs(kwargs))
    transcript, events = read_transcript(client, request_id)
    if not events and not is_queued(client, request_id):
        raise unknown_request(client, request_id)
    printer = EventPrinter(json_lines=json_lines)
    if follow and not transcript.finished:
        try:
            printer.follow(client, request_id, timeout)
        except ResultTimeout as exc:
            raise LLMQError(f"{exc}; run `llmq result {request_id} --follow` again") from None
        return
    for event in events:
        printer.show(event)
    if isinstance(transcript.final, Error):
        raise RequestFailed(transcript.final)
    if transcript.final is None:
        if printer.shown:
            click.echo("")
        state = (f"running (attempt {transcript.attempt})" if transcript.attempt
                 else "queued, not started yet")
        note(f"request {request_id} is {state}; `llmq result {request_id} --follow` waits for "
             "the rest")


@click.command()
@click.argument("request_ids", nargs=-1, required=True, metavar="REQUEST_ID...")
@connection_options
def cancel(request_ids: tuple[str, ...], **kwargs: Any) -> None:
    """Cancel requests: queued ones never run, running ones stop (finish_reason cancelled)."""
    client = open_client(**connection_kwargs(kwargs))
    unknown = []
    for request_id in request_ids:
        transcript, events = read_transcript(client, request_id)
        if isinstance(transcript.final, Done | Error):
            how = (transcript.final.finish_reason if isinstance(transcript.final, Done)
                   else f"error {transcript.final.code}")
            note(f"request {request_id} already finished ({how}): nothing to cancel")
            continue
        if not events and not is_queued(client, request_id):
            unknown.append(request_id)
            continue
        client.cancel(request_id)
        click.echo(f"cancel requested for {request_id}")
    if unknown:
        raise unknown_request(client, ", ".join(unknown))
