"""deploy/env.md against the CLI: the deployment files and `llmq worker` use the same names.

compose.yaml and k8s/ configure the worker only through LLMQ_* variables; a name the CLI does
not read is silently ignored, so the table they are checked against must be the CLI's own.
"""

from __future__ import annotations

import click

from tests.unit.worker_settings import worker_settings


def _cli_env_vars() -> dict[str, str]:
    """Environment variable -> long flag, for `llmq worker` and the `llmq` group around it."""
    from llmq.cli.main import cli

    assert "worker" in cli.commands, "`llmq worker` is not registered in llmq.cli.main:cli"
    found: dict[str, str] = {}
    for command in (cli, cli.commands["worker"]):
        for param in command.params:
            if not isinstance(param, click.Option) or not param.envvar:
                continue
            names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
            flag = next(o for o in param.opts if o.startswith("--"))
            for name in names:
                found[name] = flag
    return found


def test_worker_flags_and_env_vars_match_the_cli():
    # Given the documented settings and the options click declares
    documented = {name: flag for name, flag in worker_settings().items() if flag is not None}
    # Then both name the same variables, each with the same flag
    assert _cli_env_vars() == documented


def test_the_table_lists_the_settings_deployments_need():
    # Given the table the deployment tests check against
    settings = worker_settings()
    # Then it has the names compose.yaml and k8s/ must be able to set, with their flags
    for name, flag in {"LLMQ_REDIS_URL": "--redis-url", "LLMQ_QUEUE": "--queue",
                       "LLMQ_DRAIN_TIMEOUT": "--drain-timeout",
                       "LLMQ_METRICS_PORT": "--metrics-port", "LLMQ_THREADS": "--threads"}.items():
        assert settings[name] == flag
    assert settings["LLMQ_MODEL_DIR"] is None  # read by the model fetcher, not a flag
