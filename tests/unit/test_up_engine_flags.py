"""`llmq up`'s engine flags reach every worker it starts; an on/off flag as the bare flag."""

from __future__ import annotations

from typing import Any

import click
from click.testing import CliRunner

from llmq.cli.options import ENGINE_FIELDS, engine_options
from llmq.cli.up import _engine_argv


def parsed(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine flags as `llmq up` parses them from its command line and environment."""
    seen: dict[str, Any] = {}

    @click.command()
    @engine_options
    def command(**kwargs: Any) -> None:
        seen.update(kwargs)

    result = CliRunner().invoke(command, args, env=env or {})
    assert result.exit_code == 0, result.output
    return {name: seen[name] for name in ENGINE_FIELDS}


def test_batch_invariant_is_passed_to_the_workers_only_when_asked():
    # When `llmq up` is given --batch-invariant, or not
    on, off = _engine_argv(parsed(["--batch-invariant"])), _engine_argv(parsed([]))
    # Then each worker gets the bare flag, or nothing of it
    assert "--batch-invariant" in on and "True" not in on
    assert "--batch-invariant" not in off and "False" not in off


def test_the_environment_variable_turns_it_on_too():
    # When LLMQ_BATCH_INVARIANT is set for `llmq up`
    argv = _engine_argv(parsed([], {"LLMQ_BATCH_INVARIANT": "1"}))
    # Then its workers get the bare flag
    assert "--batch-invariant" in argv and "True" not in argv
