"""Helpers for the worker tests: worker processes and threads, and reading result streams.

`WorkerProcess` runs `python -m llmq.cli.main worker ...` as a child (for the tests that SIGKILL,
SIGTERM or crash it), logging to a file that is printed when a test fails. `InProcessWorker`
runs a `Worker` on a thread around an engine built from an already loaded model (fast, and the
test can look at the engine's KV cache). Both use short leases so crash tests take seconds.

`fault=` installs TEST-ONLY fault wrappers (tests/fixtures/faults.py): around the engine of an
`InProcessWorker`, and through `python -m tests.fixtures.faulty_worker` for a `WorkerProcess`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from llmq import protocol
from llmq.broker.keys import GROUP, Keys

REPO = Path(__file__).resolve().parents[2]
KEYS = Keys()
QUEUE_KEY = KEYS.queue("default")
LEASE = 1.5  # s
RENEW = 0.3  # s
HEARTBEAT = 1.5  # s: a killed worker's requests are taken within about 2 s
MAX_DELIVERIES = 3
MAX_MODEL_LEN = 256
KV_BYTES = 8_000_000  # the tiny model needs little; the default 1 GiB would be real memory


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.05) -> Any:
    """Poll until `predicate()` is truthy; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def xadd_json(r: redis.Redis, body: dict[str, Any] | str) -> str:
    """Queue a request the way any producer would: one `json` field, no llmq code."""
    payload = body if isinstance(body, str) else json.dumps(body)
    return r.xadd(QUEUE_KEY, {"json": payload}).decode()


def read_events(r: redis.Redis, request_id: str) -> list[protocol.Event]:
    return [protocol.decode_event(fields) for _, fields in r.xrange(KEYS.result(request_id))]


def terminal_events(events: list[protocol.Event]) -> list[protocol.Event]:
    return [e for e in events if protocol.is_terminal(e)]


def final_terminal(r: redis.Redis, request_id: str) -> protocol.Event | None:
    """The terminal event of the highest attempt that has one (what a client keeps)."""
    terminals = terminal_events(read_events(r, request_id))
    return max(terminals, key=lambda e: e.attempt) if terminals else None


def wait_terminal(r: redis.Redis, request_id: str, timeout: float = 30.0) -> protocol.Event:
    return wait_for(lambda: final_terminal(r, request_id), timeout,
                    f"a terminal event for {request_id}")


def num_pending(r: redis.Redis) -> int:
    try:
        return int(r.xpending(QUEUE_KEY, GROUP)["pending"])
    except redis.ResponseError:
        return 0


def dead_letters(r: redis.Redis) -> list[tuple[protocol.DeadLetter, dict[str, bytes]]]:
    return [protocol.decode_dead_letter(f) for _, f in r.xrange(KEYS.dlq("default"))]


def worker_args(model_path: Path | str, *, lease: float | None = LEASE,
                renew: float | None = RENEW, heartbeat: float | None = HEARTBEAT,
                drain: float = 5.0, max_num_seqs: int = 64, extra: list[str] | None = None
                ) -> list[str]:
    """`llmq worker` flags for the tiny model; a lease, renew or heartbeat of None keeps the
    worker's default."""
    timing = [arg for flag, value in (("--lease-timeout", lease), ("--renew-interval", renew),
                                      ("--heartbeat-timeout", heartbeat)) if value is not None
              for arg in (flag, str(value))]
    return ["--model", str(model_path), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES),
            "--max-num-seqs", str(max_num_seqs), *timing, "--drain-timeout", str(drain),
            "--max-deliveries", str(MAX_DELIVERIES), *(extra or [])]


class WorkerProcess:
    """`llmq worker` as a child process, logging to `<log_dir>/<worker_id>.log`."""

    def __init__(self, url: str, model_path: Path | str, log_dir: Path, worker_id: str, *,
                 fault: str = "", **kwargs: Any) -> None:
        self.url = url
        self.worker_id = worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        entry = ["tests.fixtures.faulty_worker", fault] if fault else ["llmq.cli.main"]
        self.argv = [sys.executable, "-m", *entry, "--log-level", "INFO", "worker",
                     "--redis-url", url, "--worker-id", worker_id,
                     *worker_args(model_path, **kwargs)]
        # NOTE: the repository on the path, so `tests.fixtures` imports from any folder.
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, r: redis.Redis, timeout: float = 60.0) -> WorkerProcess:
        """Until its heartbeat hash exists (model loaded, threads running, Redis reachable)."""
        key = KEYS.worker(self.worker_id)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"worker {self.worker_id} exited with {self.proc.returncode}"
                                     f" during start:\n{self.log_tail()}")
            return bool(r.exists(key))
        wait_for(ready, timeout, f"worker {self.worker_id} to be ready")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Cleanup: SIGTERM, then SIGKILL if it is still there after a few seconds."""
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        try:
            self.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class InProcessWorker:
    """A `Worker` on a thread of the test process, around a fresh engine on a loaded model."""

    def __init__(self, url: str, loaded: Any, *, worker_id: str = "inproc", fault: str = "",
                 max_num_seqs: int = 64, num_kv_blocks: int = 64, lease: float = LEASE,
                 renew: float = RENEW, heartbeat: float = HEARTBEAT,
                 max_deliveries: int = MAX_DELIVERIES, speculative_method: str | None = None,
                 draft: Any = None, **config: Any) -> None:
        from llmq.worker.engine.config import EngineConfig
        from llmq.worker.engine.engine_core import EngineCore
        from llmq.worker.worker import Worker
        from llmq.worker.worker_config import WorkerConfig
        from tests.fixtures.faults import Faults, wrap_engine

        self.engine = EngineCore(EngineConfig(model="tiny", dtype="float32",
                                              max_num_seqs=max_num_seqs,
                                              num_kv_blocks=num_kv_blocks,
                                              speculative_method=speculative_method,
                                              draft_model="tiny-draft" if draft else None),
                                 loaded=loaded, draft=draft)
        self.worker = Worker(
            WorkerConfig(redis_url=url, worker_id=worker_id, lease_timeout=lease,
                         renew_interval=renew, heartbeat_timeout=heartbeat,
                         max_deliveries=max_deliveries, **config),
            wrap_engine(self.engine, Faults.from_env(fault)), model_name="tiny")
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"worker-{worker_id}",
                                        daemon=True)

    def _run(self) -> None:
        self.exit_code = self.worker.run(install_signal_handlers=False)

    def __enter__(self) -> InProcessWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> int | None:
        self.worker.request_stop()
        self._thread.join(timeout)
        return self.exit_code

    def alive(self) -> bool:
        return self._thread.is_alive()
