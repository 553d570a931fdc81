"""The `llmq` command: one click group, commands registered from one module each."""

from __future__ import annotations

import logging

import click

from llmq.cli.generate import generate
from llmq.cli.worker import worker


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", envvar="LLMQ_LOG_LEVEL", default="WARNING", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(log_level: str) -> None:
    """llmq: a Redis-streams-backed LLM inference worker pool."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(generate)
cli.add_command(worker)


if __name__ == "__main__":
    cli()
