"""HealthServer: the worker's HTTP side door (`--metrics-port`) for Prometheus and Kubernetes.

- `/metrics`  the worker's `WorkerMetrics` registry in Prometheus text format.
- `/healthz`  liveness: 200 while the busy loop has called `beat()` within `liveness_timeout`
              seconds, 503 before its first beat and once it is wedged. Kubernetes restarts a
              pod whose liveness fails, so the loop must beat on every iteration, idle ones
              included (it waits for work with a timeout well under `liveness_timeout`).
- `/readyz`   readiness: 200 only after the worker said `set_ready(True)` (model loaded, warmed
              up, Redis connected), while the loop is alive and before `set_draining()`;
              503 with a one-line reason otherwise.

A stdlib `ThreadingHTTPServer` in a daemon thread: a probe never waits on the engine, and the
process exits without joining it. Flags are plain attributes written by one thread and read by
another; single reads and writes of Python objects are atomic under the GIL, which is all this
needs.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from llmq.worker.metrics import WorkerMetrics

__all__ = ["HealthServer", "MetricsPortInUse", "port_in_use"]

logger = logging.getLogger(__name__)


class MetricsPortInUse(OSError):
    """The port asked for is taken: said in one line, never as a traceback."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"metrics port {port} on {host} is in use: pick "
                         "another --metrics-port (LLMQ_METRICS_PORT), or 0 for none")


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """True when binding `host:port` fails now (checked before starting anything on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # NOTE: SO_REUSEADDR as http.server sets it, so a port in TIME_WAIT counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


class HealthServer:
    """Serves /metrics, /healthz and /readyz for one worker. Port 0 picks a free port; a
    taken one raises MetricsPortInUse."""

    def __init__(
        self,
        port: int,
        metrics: WorkerMetrics,
        host: str = "0.0.0.0",
        liveness_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if liveness_timeout <= 0:
            raise ValueError(f"liveness_timeout must be > 0, got {liveness_timeout}")
        self.metrics = metrics
        self.liveness_timeout = liveness_timeout
        self._clock = clock
        self._last_beat: float | None = None
        self._ready = False
        self._not_ready_reason = "starting: model not loaded"
        self._draining = False
        try:
            self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(host, port) from None
            raise
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="llmq-health-server", daemon=True)
        self._thread.start()
        logger.info("health server on %s:%d (/metrics /healthz /readyz)", host, self.port)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    # -- written by the worker ----------------------------------------------------------------

    def beat(self) -> None:
        """Called by the busy loop on every iteration."""
        self._last_beat = self._clock()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        """Ready = model loaded, warmed up and Redis connected. `reason` says why not."""
        self._ready = ready
        self._not_ready_reason = reason or ("ready" if ready else "not ready")

    def set_draining(self) -> None:
        """SIGTERM received: readiness fails for good, liveness keeps following the loop."""
        self._draining = True

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- read by the handler ------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        last = self._last_beat
        if last is None:
            return False, "busy loop has not started"
        age = self._clock() - last
        if age > self.liveness_timeout:
            return False, f"busy loop silent for {age:.1f}s (limit {self.liveness_timeout:g}s)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        if self._draining:
            return False, "draining"
        if not self._ready:
            return False, self._not_ready_reason
        alive, why = self.liveness()
        if not alive:
            return False, why
        return True, "ok"


def _make_handler(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0 closes each connection: probes and scrapes are one request each.
        protocol_version = "HTTP/1.0"

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send_check(*server.liveness())
            elif path == "/readyz":
                self._send_check(*server.readiness())
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _send_check(self, ok: bool, reason: str) -> None:
            self._send(200 if ok else 503, (reason + "\n").encode())

        def _send(self, status: int, body: bytes,
                  content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            # Probes hit every few seconds: keep them out of the worker's log unless debugging.
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler
