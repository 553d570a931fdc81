"""`llmq dlq list | retry | purge`: requests that failed `max_deliveries` times or could not be
decoded, kept with the reason in `<prefix>:dlq:<queue>`."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from llmq.cli.helpers import ago, echo_json, open_client, table
from llmq.cli.options import connection_kwargs, connection_options
from llmq.protocol.errors import LLMQError


@click.group()
def dlq() -> None:
    """Inspect, retry or purge dead letters."""


@dlq.command("list")
@click.option("--count", type=click.IntRange(min=1), default=100, show_default=True,
              help="Oldest N dead letters.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@connection_options
def list_(count: int, as_json: bool, **kwargs: Any) -> None:
    """List the queue's dead letters, oldest first."""
    client = open_client(**connection_kwargs(kwargs))
    entries = client.dead_letters(count=count)
    if as_json:
        for e in entries:
            echo_json({"dlq_entry_id": e.dlq_entry_id,
                       **msgspec.structs.asdict(e.dead_letter),
                       "payload": {k: v.decode(errors="replace") for k, v in e.payload.items()}})
        return
    if not entries:
        click.echo(f"no dead letters in queue {client.settings.queue!r}")
        return
    click.echo(table(
        ["ENTRY", "REQUEST", "CODE", "DELIVERIES", "WHEN", "MESSAGE"],
        [[e.dlq_entry_id, e.dead_letter.request_id or "-", e.dead_letter.code,
          e.dead_letter.deliveries, ago(e.dead_letter.at_ms), e.dead_letter.message[:80]]
         for e in entries]))


@dlq.command()
@click.argument("entry_ids", nargs=-1, metavar="[ENTRY_ID]...")
@click.option("--all", "retry_all", is_flag=True, help="Retry every dead letter of the queue.")
@connection_options
def retry(entry_ids: tuple[str, ...], retry_all: bool, **kwargs: Any) -> None:
    """Queue dead letters again (by their ENTRY id from `llmq dlq list`), then drop them."""
    if bool(entry_ids) == retry_all:
        raise click.UsageError("give ENTRY_IDs or --all")
    client = open_client(**connection_kwargs(kwargs))
    if retry_all:
        entry_ids = tuple(e.dlq_entry_id for e in client.dead_letters(count=1_000_000))
    failures = []
    for entry_id in entry_ids:
        try:
            new_id = client.retry_dead_letter(entry_id)
        except LLMQError as exc:
            failures.append(str(exc))
            continue
        click.echo(f"requeued {entry_id} as {new_id}")
    if failures:
        raise LLMQError("; ".join(failures))


@dlq.command()
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@connection_options
def purge(yes: bool, **kwargs: Any) -> None:
    """Delete every dead letter of the queue."""
    client = open_client(**connection_kwargs(kwargs))
    queue = client.settings.queue
    if not yes:
        click.confirm(f"Delete every dead letter of queue {queue!r}?", abort=True)
    count = client.purge_dead_letters()
    click.echo(f"purged {count} dead letter{'' if count == 1 else 's'} from queue {queue!r}")
