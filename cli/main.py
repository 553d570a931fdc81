"""The `llmq` command: one click group, commands registered from one module each.

Every error llmq raises on purpose (`LLMQError`: no server, bad request, unknown id...) is shown
as one `Error: ...` line with exit code 1, never a traceback; the group does that once for all
commands, so no command can forget it.
"""

from __future__ import annotations

import logging
from typing import Any

import click
import redis

from llmq.cli.acl import acl
from llmq.cli.admin import admin
from llmq.cli.batch import batch, batch_worker
from llmq.cli.bench import bench
from llmq.cli.dlq import dlq
from llmq.cli.generate import generate
from llmq.cli.result import cancel, result
from llmq.cli.run import run
from llmq.cli.serve import serve
from llmq.cli.status import status
from llmq.cli.submit import submit
from llmq.cli.up import down, up
from llmq.cli.worker import worker
from llmq.protocol.errors import LLMQError


class LLMQGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LLMQError as exc:
            raise click.ClickException(str(exc)) from None
        except redis.RedisError as exc:
            # NOTE: the broker translates its own calls; this catches the rest (rq's, mostly).
            raise click.ClickException(f"Redis error: {exc}") from None


@click.group(cls=LLMQGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", envvar="LLMQ_LOG_LEVEL", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(log_level: str) -> None:
    """llmq: a Redis-streams-backed LLM inference worker pool."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


for command in (up, down, submit, run, result, cancel, status, dlq, batch, batch_worker, bench,
                worker, generate, serve, admin, acl):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
