"""What the commands share: opening a client from the connection flags, tables, JSON lines.

After rq's `cli/helpers.py`: small functions the command modules call, nothing stateful.
"""

from __future__ import annotations

import io
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table

from llmq.broker.client import Client

_json = msgspec.json.Encoder()


def open_client(redis_url: str | None, prefix: str, queue: str) -> Client:
    """A Client for the connection flags; nothing is sent until the first command."""
    return Client(redis_url, prefix=prefix, queue=queue)


def warn_if_unserved(client: Client) -> None:
    """Say so when no live worker serves the queue: a request would just wait."""
    queue = client.settings.queue
    if not any(w.queue == queue for w in client.workers()):
        note(f"no worker is serving queue {queue!r} right now: requests wait until one "
             "starts (`llmq up`, or `llmq worker`)")


def to_json(value: Any) -> str:
    """One JSON line (msgspec Structs, dataclasses and plain values alike)."""
    return _json.encode(value).decode()


def echo_json(value: Any) -> None:
    click.echo(to_json(value))


def note(message: str) -> None:
    """A message for the person at the terminal, on stderr, so stdout stays the answer."""
    click.echo(click.style("[llmq] ", dim=True) + message, err=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns under their headers, two spaces apart (like `docker ps`), drawn by rich: bold
    headers on a terminal, plain text elsewhere so scripts and logs can cut columns."""
    tty = sys.stdout.isatty()
    grid = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0),
                 header_style="bold" if tty else "")
    for header in headers:
        grid.add_column(str(header), no_wrap=not tty)
    for row in rows:
        grid.add_row(*("" if cell is None else str(cell) for cell in row))
    out = io.StringIO()
    # NOTE: off a terminal nothing is wrapped or cut: the table is as wide as its content.
    width = shutil.get_terminal_size().columns if tty else 10_000
    Console(file=out, width=width, force_terminal=tty, color_system="auto" if tty else None,
            highlight=False, markup=False).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def ago(unix_ms: int, now: float | None = None) -> str:
    """'3s ago' for a unix-ms timestamp."""
    if not unix_ms:
        return "never"
    seconds = max(0.0, (time.time() if now is None else now) - unix_ms / 1000)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"
