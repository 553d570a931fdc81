"""PoolTokenRate: the tokens a queue's workers generate per second, read off their heartbeats.

A file job's results arrive in waves (a batch of requests that started together ends together),
so a rate or an ETA computed from finished requests reads 0 for the first wave's whole length and
jumps with each one after. The workers count every generated token in their heartbeats as they
go (`generated_tokens_total`, docs/protocol.md section 9); the difference between a worker's
heartbeats over their own timestamps is its exact rate, whatever the moment they are read, and
the workers' rates add up. So the CLI's progress shows the pool's real throughput from its first
seconds, for one cheap read a second.

It is the queue's throughput, not the job's alone: with other jobs on the same queue it is their
sum (the bars say "pool").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmq.protocol import WorkerHeartbeat
from llmq.protocol.errors import LLMQError

__all__ = ["PoolTokenRate"]

WINDOW_S = 10.0  # the rate is taken over the last this many seconds of heartbeats
_READ_EVERY_S = 1.0


class PoolTokenRate:
    """`observe(heartbeats)` as they are read; `tokens_per_s` and `tokens_since_start`."""

    def __init__(self, queue: str, *, window_s: float = WINDOW_S,
                 read: Callable[[], list[WorkerHeartbeat]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.window_ms = int(window_s * 1000)
        self._read = read
        self._clock = clock
        self._read_at: float | None = None
        # worker id -> its (heartbeat ms, generated tokens, busy before) within the window,
        # oldest first; `busy before`: it generated since the heartbeat before
        self._beats: dict[str, deque[tuple[int, int, bool]]] = {}
        self._first: dict[str, int] = {}  # worker id -> its count when first seen
        self._gone = 0  # tokens counted by workers no longer beating

    def poll(self) -> None:
        """Read the heartbeats (through `read`) at most once a second; a failed read (Redis
        away for a moment) leaves the figures as they were."""
        now = self._clock()
        if self._read is None or (self._read_at is not None
                                  and now - self._read_at < _READ_EVERY_S):
            return
        self._read_at = now
        try:
            heartbeats = self._read()
        except LLMQError:
            return  # NOTE: a figure on a progress bar is not worth failing the job over
        self.observe(heartbeats)

    def observe(self, heartbeats: list[WorkerHeartbeat]) -> None:
        live = {b.worker_id: b for b in heartbeats if b.queue == self.queue and b.heartbeat_ms}
        for gone in self._beats.keys() - live.keys():
            beats = self._beats.pop(gone)
            self._gone += beats[-1][1] - self._first.pop(gone)
        for worker_id, beat in live.items():
            beats = self._beats.setdefault(worker_id, deque())
            self._first.setdefault(worker_id, beat.generated_tokens_total)
            if beats and beat.heartbeat_ms <= beats[-1][0]:
                continue  # the same heartbeat read again
            if beats and beat.generated_tokens_total < beats[-1][1]:
                beats.clear()  # a restarted worker counts from 0 again
                self._first[worker_id] = 0
            busy = bool(beats) and beat.generated_tokens_total > beats[-1][1]
            beats.append((beat.heartbeat_ms, beat.generated_tokens_total, busy))
            # NOTE: one heartbeat older than the window is kept, so the rate spans the whole
            # window instead of whatever part of it heartbeats happen to fall in.
            while len(beats) > 2 and beats[1][0] <= beat.heartbeat_ms - self.window_ms:
                beats.popleft()
            # NOTE: idle intervals before the work began are dropped, and so is the first busy
            # one (work began somewhere inside it) once a whole busy interval is there: they
            # would only drag the rate down, and a job's first seconds would read half speed.
            # Idle intervals after work stay: then the rate falls as it should.
            while len(beats) > 2 and (beats[1][1] == beats[0][1] or not beats[0][2]):
                beats.popleft()

    @property
    def tokens_per_s(self) -> float | None:
        """The workers' summed rate over the window; None until one has two heartbeats."""
        rates = [(b[-1][1] - b[0][1]) * 1000 / (b[-1][0] - b[0][0])
                 for b in self._beats.values() if len(b) > 1 and b[-1][0] > b[0][0]]
        return sum(rates) if rates else None

    @property
    def tokens_since_start(self) -> int:
        """Tokens the queue's workers generated since this started watching them."""
        return self._gone + sum(b[-1][1] - self._first[w] for w, b in self._beats.items() if b)
