"""Helpers for the gateway tests: `llmq serve` as a real child process, and raw SSE reading.

`GatewayProcess` starts `python -m llmq.cli.main serve` on a free port with the given API keys,
waits for `/health`, logs to a file (printed when a start fails) and stops by its own PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

from llmq.broker.embedded import free_port
from tests.integration.worker_harness import WorkerProcess

KEYS = {"alice": "sk-alice", "bob": "sk-bob"}


class GatewayProcess:
    def __init__(self, url: str, log_dir: Path, *, name: str = "gateway",
                 keys: dict[str, str] | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        keys = KEYS if keys is None else keys
        self.argv = [sys.executable, "-m", "llmq.cli.main", "serve", "--redis-url", url,
                     "--port", str(self.port),
                     *[arg for tenant, key in keys.items() for arg in ("--api-key",
                                                                      f"{tenant}={key}")],
                     *(extra or [])]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("LLMQ_API_KEYS", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"llmq serve exited with {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()  # not left running past the test that started it
                raise AssertionError(f"llmq serve did not answer /health:\n{self.log_tail()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_exit(self, timeout: float) -> int:
        """Its exit code; past `timeout`, AssertionError with its log, every thread's stack
        (SIGUSR1) and any teardown step it logged as stuck."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            raise AssertionError(f"llmq serve did not exit within {timeout:g}s:\n"
                                 f"{self.log_tail(120)}") from None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def openai(self, tenant: str = "alice", **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=KEYS[tenant],
                             max_retries=0, **kwargs)

    def async_openai(self, tenant: str = "alice", **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=KEYS[tenant],
                                  max_retries=0, **kwargs)


@contextlib.contextmanager
def gateway_pool(url: str, model_path: Path, logs: Path, worker_id: str,
                 max_model_len: int) -> Iterator[GatewayProcess]:
    """One tiny-model worker (a 32 MiB KV cache) and a gateway in front of it, both stopped at
    the end."""
    worker = WorkerProcess(url, model_path, logs, worker_id,
                           extra=["--max-model-len", str(max_model_len),
                                  "--kv-cache-memory-bytes", str(32 << 20)]).start()
    r = redis.Redis.from_url(url)
    worker.wait_ready(r)
    r.close()
    gateway = GatewayProcess(url, logs)
    try:
        yield gateway.start()
    finally:
        gateway.stop()
        worker.stop()


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(id, data) of each event of a server-sent event stream."""
    events, event_id, data = [], None, []
    for line in text.split("\n"):
        if not line:
            if data:
                events.append((event_id, "\n".join(data)))
            event_id, data = None, []
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data.append(line[6:])
    return events
