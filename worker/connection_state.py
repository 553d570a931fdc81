"""ConnectionState: which of the worker's threads cannot reach Redis right now.

Each thread's `Backoff` marks it down when an outage starts and up when a command succeeds again;
the busy loop reports the worker ready (`/readyz`) only while none is down.
"""

from __future__ import annotations

import threading

__all__ = ["ConnectionState"]


class ConnectionState:
    """Threads named in `pending` count as down until their first successful command."""

    def __init__(self, pending: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._down: set[str] = set(pending)

    def mark(self, thread: str, up: bool) -> None:
        with self._lock:
            if up:
                self._down.discard(thread)
            else:
                self._down.add(thread)

    @property
    def connected(self) -> bool:
        with self._lock:
            return not self._down

    def down(self) -> list[str]:
        with self._lock:
            return sorted(self._down)
