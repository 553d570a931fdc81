"""IOThread: one daemon thread of the worker process, looping in `_run` until stopped.

The lease keeper and the reclaimer are each one such thread with a connection of their own, so
that a slow Redis call of one never delays the other (a late renewal lets peers take live work).
"""

from __future__ import annotations

import threading

__all__ = ["IOThread"]


class IOThread:
    """Subclasses implement `_run`, which returns once `stop_event` is set."""

    def __init__(self, name: str) -> None:
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(timeout=10)
