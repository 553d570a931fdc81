"""The chaos soak's front ends (bench/chaos.py --frontends): `llmq serve` and `llmq batch-worker`
processes, SIGKILLed while batches and streams run through them.

One gateway (tenant `chaos`, key `sk-chaos`) and two batch workers, each restarted whenever it
exits (as Kubernetes restarts pods). While the soak runs, a batch of `BATCH_LINES` lines is
created through the gateway every few seconds and a streaming completion is read through it one
after another. Two more faults join the soak's rounds:

    batch_worker_kill  SIGKILL a batch worker and its work horse (mid-batch, when one runs)
    gateway_kill       SIGKILL the gateway (mid-stream, when one is open)

Invariants, on top of the soak's own: every batch created ends `completed`, its output and error
files holding each `custom_id` exactly once; every stream the gateway accepted is a request
of the soak's like any other (one terminal event for its final attempt, whatever happened to the
gateway in between): `accepted` hands them to the soak's checks.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llmq.broker.embedded import free_port

FRONTEND_FAULTS = ("batch_worker_kill", "gateway_kill")
TENANT, API_KEY = "chaos", "sk-chaos"
BATCH_LINES = 20
_FINAL = ("completed", "failed", "cancelled", "expired")



def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (and SIGCONT, for one a fault paused) to all, then 20 s each to exit, then KILL."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

class Frontends:
    def __init__(self, url: str, log_dir: Path, rng: random.Random, model: str) -> None:
        self.url, self.log_dir, self.rng, self.model = url, log_dir, rng, model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "LLMQ_REDIS_URL": url,
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.env.pop("LLMQ_API_KEYS", None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # role-n -> process
        self.batches: dict[str, list[str]] = {}  # batch id -> its custom ids
        self.accepted: dict[str, float] = {}  # streamed llmq request id -> accepted at (unix)
        self.refused = 0  # batches or streams the gateway could not take (it was down)
        self._generation = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._spawn("gateway")
        for _ in range(2):
            self._spawn("batch-worker")
        self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                            name="chaos-frontends")
        self._supervisor.start()

    # -- the processes ----------------------------------------------------------------------------

    def _spawn(self, role: str) -> None:
        self._generation += 1
        name = f"{role}-{self._generation}"
        argv = [sys.executable, "-m", "llmq.cli.main", role]
        if role == "gateway":
            argv = [sys.executable, "-m", "llmq.cli.main", "serve", "--port", str(self.port),
                    "--api-key", f"{TENANT}={API_KEY}"]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                env=self.env)

    def _supervise(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                for name, proc in list(self.procs.items()):
                    if proc.poll() is not None:
                        del self.procs[name]
                        self._spawn(name.rsplit("-", 1)[0])
            self._closing.wait(0.2)

    def _pick(self, role: str) -> subprocess.Popen[bytes] | None:
        with self._lock:
            live = [p for n, p in self.procs.items() if n.startswith(role) and p.poll() is None]
        return self.rng.choice(live) if live else None

    def batch_worker_kill(self) -> bool:
        if (proc := self._pick("batch-worker")) is None:
            return False
        horse = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        horses = [int(p) for p in horse.read_text().split()] if horse.exists() else []
        proc.send_signal(signal.SIGKILL)
        for pid in horses:  # the work horse running a batch: our own child's child, by PID
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    def gateway_kill(self) -> bool:
        if (proc := self._pick("gateway")) is None:
            return False
        proc.send_signal(signal.SIGKILL)
        return True

    def close(self) -> None:
        self._closing.set()
        self._supervisor.join()
        stop_processes(list(self.procs.values()))

    # -- the traffic ------------------------------------------------------------------------------

    def produce(self, stop: threading.Event) -> None:
        """Batches every few seconds and streams back to back, until `stop`."""
        threading.Thread(target=self._stream_forever, args=(stop,), daemon=True,
                         name="chaos-streams").start()
        n = 0
        with httpx.Client(base_url=self.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            while not stop.is_set():
                n += 1
                custom_ids = [f"b{n}-{i}" for i in range(BATCH_LINES)]
                lines = "".join(json.dumps({
                    "custom_id": c, "method": "POST", "url": "/v1/completions",
                    "body": {"model": self.model, "prompt": c, "ignore_eos": True,
                             "max_tokens": self.rng.randint(8, 120), "temperature": 0}})
                    + "\n" for c in custom_ids)
                try:
                    file_id = http.post("/v1/files", data={"purpose": "batch"}, files={
                        "file": ("chaos.jsonl", io.BytesIO(lines.encode()))}).json()["id"]
                    batch = http.post("/v1/batches", json={
                        "input_file_id": file_id, "endpoint": "/v1/completions",
                        "completion_window": "24h"}).json()
                    self.batches[batch["id"]] = custom_ids
                except (httpx.HTTPError, KeyError, ValueError):
                    self.refused += 1
                stop.wait(self.rng.uniform(3.0, 8.0))

    def _stream_forever(self, stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            public_id = f"s-{n}"
            body = {"model": self.model, "prompt": public_id, "ignore_eos": True,
                    "max_tokens": self.rng.randint(20, 200), "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, headers={
                        "Authorization": f"Bearer {API_KEY}", "X-Request-Id": public_id,
                        "X-Keep-On-Disconnect": "true"}, timeout=60) as response:
                    if response.status_code == 200:
                        self.accepted[f"{TENANT}:{public_id}"] = time.time()
                    for _ in response.iter_bytes():
                        pass
            except httpx.HTTPError:
                self.refused += 1
                stop.wait(0.5)

    # -- the checks -------------------------------------------------------------------------------

    def settle(self, timeout: float) -> tuple[dict[str, int], list[str]]:
        """Wait for every batch to end; (batch outcomes, violations)."""
        outcomes: dict[str, int] = {}
        violations = []
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            for batch_id, custom_ids in self.batches.items():
                batch = self._final(http, batch_id, deadline)
                status = batch.get("status", "unknown") if batch else "unfinished"
                outcomes[status] = outcomes.get(status, 0) + 1
                if status != "completed":
                    violations.append(f"batch {batch_id}: {status}")
                    continue
                seen = [json.loads(line)["custom_id"] for key in ("output_file_id",
                                                                  "error_file_id")
                        if batch.get(key)
                        for line in http.get(f"/v1/files/{batch[key]}/content").text.split("\n")
                        if line]
                if sorted(seen) != sorted(custom_ids):
                    violations.append(f"batch {batch_id}: custom ids {len(seen)} lines, "
                                      f"{len(set(seen))} distinct, {len(custom_ids)} expected")
        return outcomes, violations

    def _final(self, http: httpx.Client, batch_id: str, deadline: float) -> dict | None:
        """The batch once final; None if not by `deadline` (looked at once at least, so one
        stuck batch does not make the ones after it unfinished)."""
        while True:
            try:
                batch = http.get(f"/v1/batches/{batch_id}").json()
                if batch.get("status") in _FINAL:
                    return batch
            except (httpx.HTTPError, ValueError):
                pass  # the gateway restarting
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)
