"""`llmq submit`: one prompt (streamed to the terminal) or a JSONL file of requests.

    llmq submit "Write a haiku about queues"            # streams the answer
    llmq submit --chat "What is Redis?" --temperature 0
    echo "Summarise: ..." | llmq submit -
    llmq submit -f requests.jsonl -o results.jsonl     # pipelined, progress bar, resumable

Every request is validated by the worker's own decoder before anything is sent, so a bad flag
or field is reported here, naming the field, and nothing is queued.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import click

from llmq.cli.event_printer import EventPrinter
from llmq.cli.helpers import note, open_client, warn_if_unserved
from llmq.cli.options import (
    connection_kwargs,
    connection_options,
    sampling_kwargs,
    sampling_options,
)
from llmq.protocol.errors import LLMQError, ResultTimeout


def _messages(value: str | None) -> list[Mapping[str, str]] | None:
    if value is None:
        return None
    try:
        messages = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--messages") from None
    if not isinstance(messages, list):
        raise click.BadParameter('a JSON list like [{"role": "user", "content": "Hi"}]',
                                 param_hint="--messages")
    return messages


@click.command()
@click.argument("prompt", required=False)
@click.option("--chat", metavar="TEXT", help="A user message (rendered with the chat template).")
@click.option("--messages", metavar="JSON", help='Chat messages: [{"role": ..., "content": ...}].')
@click.option("-f", "--file", "file",
              type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="A JSONL file of requests (wire format), or - for stdin.")
@click.option("-o", "--output", default="-", show_default=True,
              type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="With -f: where results go (JSONL, input order). Rerun to resume.")
@click.option("--id", "request_id", metavar="ID",
              help="Request id (submitting the same id again queues nothing).")
@click.option("--priority", type=click.IntRange(-1_000_000, 1_000_000), default=None,
              help="Lower runs first (workers started with --scheduling-policy priority).")
@click.option("--no-stream", is_flag=True, help="Print only the final text, once it is done.")
@click.option("--json", "json_lines", is_flag=True, help="Print every event as one JSON line.")
@click.option("--no-wait", is_flag=True, help="Print the request id and return at once.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Give up waiting after this many seconds (the request keeps running).")
@click.option("--progress/--no-progress", default=None,
              help="With -f: progress bar on stderr (default: when stderr is a terminal).")
@sampling_options
@connection_options
def submit(prompt: str | None, chat: str | None, messages: str | None, file: str | None,
           output: str, request_id: str | None, priority: int | None, no_stream: bool,
           json_lines: bool, no_wait: bool, timeout: float | None, progress: bool | None,
           **kwargs: Any) -> None:
    """Submit PROMPT (- reads stdin), a --chat message, --messages, or a JSONL file (-f).

    A single request streams its answer as tokens arrive; Ctrl-C cancels it. A file is
    submitted all at once and its results are written in input order to -o; rerunning the same
    command skips the requests whose results are already there.
    """
    given = [name for name, value in (("PROMPT", prompt), ("--chat", chat),
                                      ("--messages", messages), ("-f", file)) if value is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of PROMPT, --chat, --messages or -f FILE"
                               + (f" (got {', '.join(given)})" if given else ""))
    params = sampling_kwargs(kwargs)
    if priority is not None:
        params["priority"] = priority
    client = open_client(**connection_kwargs(kwargs))
    if file is not None:
        if request_id is not None or no_wait or json_lines:
            raise click.UsageError("--id, --no-wait and --json apply to a single request, not -f")
        from llmq.broker.file_job import FileJob  # the file runner only when a file is given
        from llmq.cli.progress import FileJobProgress

        job = FileJob(client, file, output, params, timeout=timeout,
                      listener=FileJobProgress(client, enabled=progress))
        try:
            code = job.run()
        except OSError as exc:  # the output folder is missing, the disk is full...
            raise click.FileError(exc.filename or output, exc.strerror) from None
        sys.exit(code)
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise click.UsageError("stdin was empty: nothing to submit")
    chat_messages: list[Mapping[str, str]] | None = (
        [{"role": "user", "content": chat}] if chat is not None else _messages(messages))
    if no_stream:
        params["stream"] = False
    request_id = client.submit(prompt, messages=chat_messages, request_id=request_id, **params)
    if no_wait:
        click.echo(request_id)
        return
    if not json_lines:
        warn_if_unserved(client)
    printer = EventPrinter(json_lines=json_lines, stream=not no_stream)
    try:
        printer.follow(client, request_id, timeout)
    except ResultTimeout as exc:
        raise LLMQError(f"{exc}; `llmq result {request_id} --follow` picks it up again") from None
    except KeyboardInterrupt:
        # NOTE: like closing an OpenAI stream: nobody is reading, so stop spending the tokens.
        client.cancel(request_id)
        if printer.shown:
            click.echo("")
        note(f"cancelled request {request_id}")
        sys.exit(130)
