"""`llmq up` / `llmq down`: a whole pool on one machine, stopped without leaving anything behind.

Each test gets its own run folder (LLMQ_RUN_DIR), so the embedded server's socket, URL file and
pidfiles are private to it; workers load the tiny model.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.e2e.cli_harness import LLMQ, subprocess_env
from tests.fixtures.redis_servers import require_binary

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_binary("valkey")
    # NOTE: short, so the server gets a unix socket (sun_path holds ~104 bytes)
    return tmp_path_factory.mktemp("up")


@pytest.fixture
def env(run_dir: Path, tiny_model_path: Path) -> dict[str, str]:
    return subprocess_env(run_dir=run_dir, LLMQ_MODEL=str(tiny_model_path),
                          LLMQ_DTYPE="float32", LLMQ_MAX_MODEL_LEN="256",
                          LLMQ_KV_CACHE_MEMORY_BYTES="8000000")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


def recorded_pids(run_dir: Path) -> list[int]:
    """The server's and the workers' PIDs, from the files `llmq up` keeps."""
    pids = [int((run_dir / "redis.pid").read_text())]
    pids += [int(p.read_text().split()[0]) for p in (run_dir / "workers").glob("*.pid")]
    return pids


def assert_nothing_left(run_dir: Path, pids: list[int]) -> None:
    assert [pid for pid in pids if alive(pid)] == []
    left = [p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")
            if p.suffix in (".sock", ".pid", ".url")]
    assert left == []


def llmq_run(*args: str, env: dict[str, str], timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LLMQ, *args], env=env, text=True, capture_output=True,
                          timeout=timeout)


class Foreground:
    """`llmq up` in the foreground, its output read line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([*LLMQ, "up", *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for_line(self, text: str, timeout: float = 60) -> str:
        while True:
            line = self._queue.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"`llmq up` exited before {text!r}:\n{self.output}")
            self.lines.append(line)
            if text in line:
                return line

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def test_up_submit_then_ctrl_c_leaves_no_process_or_socket(run_dir: Path,
                                                          env: dict[str, str]) -> None:
    # Given `llmq up` with two workers in the foreground
    up = Foreground(["--workers", "2"], env)
    try:
        up.wait_for_line("ready: 2 worker(s)")
        pids = recorded_pids(run_dir)
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        assert (run_dir / "redis.sock").is_socket()
        # When a prompt is submitted with no configuration at all
        submitted = llmq_run("submit", "Hello", "--max-tokens", "8", "--ignore-eos", env=env)
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.strip() and submitted.stderr == ""
        # And Ctrl-C is pressed
        up.proc.send_signal(signal.SIGINT)
        code = up.finish()
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    # Then the workers drained and stopped first, then the server, and nothing is left
    assert code == 0, up.output
    log = up.output
    assert log.index("worker-1 | stopped (exit 0)") < log.index("server   | stopped")
    assert "worker-2 | stopped (exit 0)" in log
    assert_nothing_left(run_dir, pids)
    # And the log is readable: every line carries its process's name
    assert all(line.split("|")[0].strip() in ("server", "worker-1", "worker-2", "llmq")
               for line in up.lines)


def test_detach_status_and_down(run_dir: Path, env: dict[str, str]) -> None:
    # Given a detached pool
    started = llmq_run("up", "--detach", "--workers", "2", env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "llmq is up: 2 worker(s)" in started.stdout
        pids = recorded_pids(run_dir)
        # Then other commands find it, and its two workers are live
        status = llmq_run("status", env=env)
        assert status.returncode == 0 and status.stdout.count("tiny-llama.gguf") == 2
        # And a second `llmq up` refuses to start another over it
        again = llmq_run("up", "--detach", env=env)
        assert again.returncode == 1 and "already up" in again.stderr
    finally:
        # When `llmq down` runs
        down = llmq_run("down", env=env)
    # Then both workers and the server are stopped, leaving nothing behind
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip().startswith("stopped 2 worker(s) and the server at unix://")
    assert_nothing_left(run_dir, pids)
    assert "llmq is not up" in llmq_run("down", env=env).stdout


def free_port_range(count: int) -> int:
    """A base port with `count` free ports after it (as free as can be told now)."""
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise AssertionError("no free port range")


def test_metrics_port_env_gives_each_worker_its_own_port(run_dir: Path,
                                                         env: dict[str, str]) -> None:
    import urllib.request

    # Given LLMQ_METRICS_PORT set for a two-worker pool (once a crash of the second worker)
    base = free_port_range(2)
    started = llmq_run("up", "--detach", "--workers", "2", env={**env,
                       "LLMQ_METRICS_PORT": str(base)})
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        # Then both workers answer on BASE and BASE+1 with vLLM-style series
        for port in (base, base + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                body = r.read().decode()
            assert "llmq_time_to_first_token_seconds_bucket" in body
            assert "llmq_kv_cache_usage_ratio" in body
        # And the gateway's /metrics answers without a key with both workers' series
        from tests.e2e.gateway_harness import GatewayProcess

        url = (run_dir / "redis.url").read_text().strip()
        gateway = GatewayProcess(url, run_dir, env=env).start()
        try:
            with urllib.request.urlopen(f"{gateway.base_url}/metrics", timeout=10) as r:
                pool = r.read().decode()
        finally:
            gateway.stop()
        for name in ("llmq_time_to_first_token_seconds_count",
                     "llmq_inter_token_latency_seconds_count", "llmq_kv_cache_usage_ratio"):
            workers = {line.split('worker="')[1].split('"')[0] for line in pool.splitlines()
                       if line.startswith(name + "{")}
            assert len(workers) == 2, (name, workers)
    finally:
        down = llmq_run("down", env=env)
    assert down.returncode == 0, down.stderr


def test_a_taken_metrics_port_is_a_one_line_error_before_anything_starts(
        run_dir: Path, env: dict[str, str]) -> None:
    import socket

    # Given a port something else listens on
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # When a pool is asked to put its second worker's metrics there
        result = llmq_run("up", "--detach", "--workers", "2", "--metrics-port", str(taken - 1),
                          env=env)
    # Then it refuses in one line, with no traceback and nothing started
    assert result.returncode == 1
    assert "already in use" in result.stderr and str(taken) in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not list((run_dir / "workers").glob("*.pid")) if (run_dir / "workers").exists() \
        else True


def test_three_up_down_cycles_leave_two_consumers_not_six(run_dir: Path,
                                                         env: dict[str, str]) -> None:
    import json
    import time

    # Given two cycles of a two-worker pool started and stopped on the same (persistent) server
    for _ in range(2):
        started = llmq_run("up", "--detach", "--workers", "2", env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        assert llmq_run("down", env=env).returncode == 0
    # When a third pool starts
    started = llmq_run("up", "--detach", "--workers", "2", env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        # Then `llmq status` counts the two live consumers, and the group soon forgets the
        # stopped workers' names (the new workers' reclaimers remove them: they hold nothing)
        deadline = time.monotonic() + 60
        while True:
            status = llmq_run("status", "--json", env=env)
            assert status.returncode == 0, status.stderr
            queue = json.loads(status.stdout)["queues"][0]
            assert queue["consumers"] == 2
            if queue["group_consumers"] == 2:
                break
            assert time.monotonic() < deadline, queue
            time.sleep(1)
        assert "CONSUMERS" in llmq_run("status", env=env).stdout
    finally:
        llmq_run("down", env=env)


def test_down_stops_a_foreground_up_like_ctrl_c(run_dir: Path, env: dict[str, str]) -> None:
    up = Foreground([], env)
    try:
        up.wait_for_line("ready: 1 worker(s)")
        pids = recorded_pids(run_dir)
        down = llmq_run("down", env=env)
        assert down.returncode == 0 and "stopped the foreground `llmq up`" in down.stdout
        assert up.finish() == 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    assert_nothing_left(run_dir, pids)


def test_a_worker_that_cannot_start_stops_the_pool(run_dir: Path, env: dict[str, str],
                                                   tmp_path: Path) -> None:
    # Given a model file that is not a model
    bad = tmp_path / "not-a-model.gguf"
    bad.write_text("hello")
    result = llmq_run("up", "--model", str(bad), env=env)
    # Then `llmq up` says which worker failed, exits 1, and stops the server it started
    assert result.returncode == 1, result.stdout
    assert "worker-1 | exited during start" in result.stdout
    assert "server   | stopped" in result.stdout
    assert_nothing_left(run_dir, [])


def test_make_run_streams_an_answer_and_stops_everything(run_dir: Path,
                                                         env: dict[str, str]) -> None:
    # Given the Makefile's `run` recipe (its install and model steps already done)
    if shutil.which("make") is None:
        pytest.skip("no make")
    bin_dir = Path(LLMQ[0]).parent
    result = subprocess.run(["make", "-s", "-o", "install", "-o", "model", "run",
                             f"BIN={bin_dir}", "PROMPT=Say hi."], cwd=REPO, env=env, text=True,
                            capture_output=True, timeout=180)
    # Then it started a pool, streamed an answer, and stopped the pool again
    assert result.returncode == 0, result.stdout + result.stderr
    before, _, rest = result.stdout.partition("llmq is up: 1 worker(s)")
    assert before and rest, result.stdout
    answer, _, stopped = rest.partition("\n")[2].rpartition("stopped 1 worker(s) and the server")
    assert answer.strip() and stopped, result.stdout
    assert_nothing_left(run_dir, [])
