"""IOThread: one daemon thread of the worker process with a Redis connection of its own,
looping in `_run` until stopped.

The lease keeper and the reclaimer are each one such thread, so that a slow Redis call of one
never delays the other (a late renewal lets peers take live work).
"""

from __future__ import annotations

import threading

from llmq.worker.worker_context import WorkerContext

__all__ = ["IOThread"]


class IOThread:
    """Subclasses implement `_run`, which returns once `stop_event` is set; the names they
    use from the worker's context are kept here."""

    def __init__(self, name: str, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.client = ctx.connect()
        self.keys = ctx.keys
        self.queue_key = ctx.queue_key
        self.worker_id = ctx.worker_id
        self.table = ctx.table
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
