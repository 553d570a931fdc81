"""Liveness: has Redis answered this worker's own heartbeats, one after another, for a while?

A worker may take a peer's requests away only when the silence it sees is that peer's alone.
When every heartbeat goes stale together (CLIENT PAUSE, a stopped, restarting or out-of-memory
Redis, or this very worker paused), the owners are most likely alive and about to renew, and a
takeover would only rerun healthy work from scratch. So the reclaimer asks `healthy_for(s)`:
this worker's own heartbeats have succeeded without a gap longer than `max_gap` for at least
`s` seconds, and the last one is recent. A failed beat, or one that took too long, starts the
count again; by the time it reaches `s`, an owner that is alive has beaten and renewed too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Liveness"]


class Liveness:
    """`interval` is the heartbeat period, `timeout` the heartbeat timeout. A gap between two
    successful beats longer than `max_gap` breaks the run: twice the period plus a second of
    slack for a loaded machine, but always under half the timeout. A stall long enough to
    expire a live peer's heartbeat (over timeout - interval) must break every observer's run."""

    def __init__(self, interval: float, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_gap = min(2 * interval + 1.0, timeout / 2)
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current run of timely beats began
        self._last: float | None = None  # when the last beat succeeded

    def beat_succeeded(self) -> None:
        now = self.clock()
        with self._lock:
            if self._since is None or self._last is None or now - self._last > self.max_gap:
                self._since = now
            self._last = now

    def beat_failed(self) -> None:
        with self._lock:
            self._since = None

    def healthy_for(self, seconds: float) -> bool:
        """Whether this worker's beats have been timely for `seconds`, up to now."""
        now = self.clock()
        with self._lock:
            return (self._since is not None and self._last is not None
                    and now - self._last <= self.max_gap and now - self._since >= seconds)
