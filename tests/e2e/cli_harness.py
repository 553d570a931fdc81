"""Helpers for the `llmq` CLI tests: run commands as a user would, against real servers.

`llmq(...)` runs a command in-process with click's CliRunner (fast; stdout and stderr kept
apart); `llmq_process(...)` runs it as a child process (for Ctrl-C, kills and `llmq up`).
`serve(...)` starts a real `llmq worker` process on the tiny model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis
from click.testing import CliRunner, Result

from llmq.cli.main import cli
from tests.integration.worker_harness import WorkerProcess

LLMQ = [sys.executable, "-m", "llmq.cli.main"]


def llmq(*args: str, url: str | None = None, input: str | None = None,
         env: dict[str, str | None] | None = None) -> Result:
    """Run `llmq ARGS` in-process; `url` becomes LLMQ_REDIS_URL."""
    environment: dict[str, str | None] = {"LLMQ_REDIS_URL": url}
    environment.update(env or {})
    return CliRunner().invoke(cli, list(args), input=input, env=environment)


def ok(result: Result) -> Result:
    """Assert the command succeeded, showing what it printed when it did not."""
    assert result.exit_code == 0, (f"exit {result.exit_code}\nstdout: {result.stdout}\n"
                                   f"stderr: {result.stderr}\nexception: {result.exception!r}")
    return result


def printed(result: Result) -> str:
    """Exactly what the command wrote to stdout. click's `Result.stdout` turns "\\r\\n" into
    "\\n", and a model's text may end in "\\r" just before the line the CLI adds."""
    return result.stdout_bytes.decode()


def one_error_line(result: Result, exit_code: int = 1) -> str:
    """The single `Error: ...` line a failing command printed (and nothing like a traceback)."""
    assert result.exit_code == exit_code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def subprocess_env(url: str | None = None, run_dir: Path | None = None,
                   **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMQ_REDIS_URL"}
    if url is not None:
        env["LLMQ_REDIS_URL"] = url
    if run_dir is not None:
        env["LLMQ_RUN_DIR"] = str(run_dir)
    env.update(extra)
    return env


def llmq_process(*args: str, env: dict[str, str], **popen: Any) -> subprocess.Popen[str]:
    """`llmq *args` running, as a person's terminal starts it: Ctrl-C (SIGINT) reaches it.

    NOTE: a test run started in the background (`make test &`, `setsid ... &` in a script) has
    SIGINT ignored, children inherit an ignored signal, and Python then never installs its
    KeyboardInterrupt handler: the Ctrl-C test saw `llmq submit` run to the end and exit 0.
    With a handler here (not SIG_IGN) the child starts with SIGINT at its default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([*LLMQ, *args], env=env, text=True, **popen)
    finally:
        signal.signal(signal.SIGINT, previous)


def serve(url: str, model_path: Path, log_dir: Path, worker_id: str, *, queue: str = "default",
          fault: str = "", max_num_seqs: int = 64) -> WorkerProcess:
    """A real `llmq worker` on the tiny model, ready (heartbeat written) when returned."""
    worker = WorkerProcess(url, model_path, log_dir, worker_id, fault=fault,
                           max_num_seqs=max_num_seqs, extra=["--queue", queue])
    worker.start()
    client = redis.Redis.from_url(url)
    try:
        worker.wait_ready(client)
    except BaseException:
        worker.stop()  # not left running when it was too slow to start (a loaded machine)
        raise
    finally:
        client.close()
    return worker
