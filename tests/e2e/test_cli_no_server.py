"""Every command, when no server answers: one line saying so and how to fix it, exit code 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmq.broker.embedded import free_port
from tests.e2e.cli_harness import llmq, one_error_line

COMMANDS = [
    ["submit", "Hello"],
    ["submit", "-f", "{requests}"],
    ["result", "some-id"],
    ["result", "some-id", "--follow"],
    ["cancel", "some-id"],
    ["status"],
    ["status", "--json"],
    ["dlq", "list"],
    ["dlq", "retry", "1-0"],
    ["dlq", "purge", "--yes"],
    ["batch", "submit", "{requests}"],
    ["batch", "status", "batch_x"],
    ["batch", "results", "batch_x"],
    ["batch", "cancel", "batch_x"],
    ["batch", "list"],
    ["batch-worker", "--burst"],
    ["bench", "-n", "1"],
]


@pytest.fixture
def requests_file(tmp_path: Path) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "Hi"}\n')
    return path


def _args(command: list[str], requests_file: Path) -> list[str]:
    return [arg.format(requests=requests_file) for arg in command]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_nothing_listening_at_the_configured_url(command: list[str], requests_file: Path) -> None:
    # Given LLMQ_REDIS_URL pointing at a port where nothing listens
    url = f"redis://127.0.0.1:{free_port()}/0"
    # When the command runs, Then it says so in one line and how to fix it
    line = one_error_line(llmq(*_args(command, requests_file), url=url))
    assert f"no Redis server at {url}" in line
    assert "llmq up" in line and "LLMQ_REDIS_URL" in line


@pytest.mark.parametrize("command", [*COMMANDS, ["worker", "--model", "x.gguf"]], ids=" ".join)
def test_no_server_configured_and_none_started(command: list[str], requests_file: Path,
                                               tmp_path: Path) -> None:
    # Given no LLMQ_REDIS_URL and no `llmq up` server under the run folder
    env = {"LLMQ_RUN_DIR": str(tmp_path / "run")}
    line = one_error_line(llmq(*_args(command, requests_file), env=env))
    assert "no Redis server configured and no embedded server running" in line
    assert "llmq up" in line


def test_a_password_in_the_url_is_never_shown(requests_file: Path) -> None:
    url = f"redis://app:s3cret@127.0.0.1:{free_port()}/0"
    line = one_error_line(llmq("status", url=url))
    assert "s3cret" not in line and "app:***@" in line


def test_down_with_nothing_running_says_so(tmp_path: Path) -> None:
    result = llmq("down", env={"LLMQ_RUN_DIR": str(tmp_path / "run")})
    assert result.exit_code == 0 and "llmq is not up" in result.stdout
