"""`llmq admin ...`: operator commands that need the admin user.

    llmq admin load-functions      # the submit function library, on every server (primary)
"""

from __future__ import annotations

import click

from llmq.broker.connection import translate_errors
from llmq.broker.functions import LIBRARY_NAME, LIBRARY_VERSION, load_functions
from llmq.cli.helpers import open_client
from llmq.cli.options import connection_kwargs, connection_options


@click.group()
def admin() -> None:
    """Operator commands (run them with an admin user's URL)."""


@admin.command("load-functions")
@connection_options
def load_functions_(**kwargs) -> None:
    """Load (or replace) the llmq Redis Function library producers submit through.

    Workers load it when they start; run this where they may not (a stricter ACL), or after
    adding primaries to a cluster. It is kept in the RDB and AOF across restarts."""
    client = open_client(**connection_kwargs(kwargs))
    with translate_errors(client.url):
        servers = load_functions(client.redis)
    click.echo(f"loaded library {LIBRARY_NAME!r} version {LIBRARY_VERSION} on {servers} "
               f"server{'s' if servers != 1 else ''}")
