"""Backoff: capped exponential retry pacing for a worker thread that talks to Redis.

Every IO thread of the worker (stream reader, result writer, lease keeper, cancel listener) loops
forever; when Redis goes away each of them keeps its state, waits, and tries again, so a Redis
restart never crash-loops the worker (docs/reliability.md, scenarios 7-9). The pattern is rq's and
redis-py's `Retry(ExponentialBackoff(cap=...))`, moved up one level so the *thread* decides what
is safe to repeat (redis-py's own retries are switched off: the threads' clients come from
`llmq.broker.connection.connect_at_most_once`, as a blindly repeated XADD would duplicate an
event).

An outage is logged once when it starts and once when it ends, not on every attempt.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import redis

from llmq.worker.connection_state import ConnectionState

logger = logging.getLogger(__name__)

# Errors that mean "Redis is unreachable or restarting", as opposed to a rejected command.
# BusyLoadingError is raised while a restarted server loads its AOF; ReadOnlyError while a
# replica is being promoted.
# On a cluster: a failover or slot migration that outlasted redis-py's own redirects and retries.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.ReadOnlyError,
    redis.exceptions.ClusterError, redis.exceptions.TryAgainError, redis.exceptions.AskError,
    redis.exceptions.SlotNotCoveredError, ConnectionError, TimeoutError, OSError,
)
# Any failure of a Redis call: a refused command, or Redis out of reach.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, *TRANSIENT_ERRORS)


class Backoff:
    """Waits between attempts: base * 2^n with jitter, capped; resets on success."""

    def __init__(self, name: str, state: ConnectionState | None = None, *, base: float = 0.05,
                 cap: float = 2.0, stop: threading.Event | None = None) -> None:
        self.name = name
        self.state = state
        self.base = base
        self.cap = cap
        self.stop = stop
        self.failures = 0
        self._outage_started: float | None = None

    def failed(self, error: BaseException) -> None:
        """Record a failed attempt and sleep before the next one (returns early on stop)."""
        self.failures += 1
        if self._outage_started is None:
            self._outage_started = time.monotonic()
            logger.warning("%s: Redis unavailable (%s: %s); retrying with backoff up to %.1f s",
                           self.name, type(error).__name__, error, self.cap)
            if self.state is not None:
                self.state.mark(self.name, up=False)
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 16))
        delay *= 0.5 + random.random() / 2  # jitter: peers must not reconnect in lockstep
        if self.stop is not None:
            self.stop.wait(delay)
        else:
            time.sleep(delay)

    def succeeded(self) -> None:
        if self._outage_started is not None:
            logger.warning("%s: Redis back after %.1f s (%d failed attempts)", self.name,
                           time.monotonic() - self._outage_started, self.failures)
            self._outage_started = None
        if self.state is not None:
            self.state.mark(self.name, up=True)
        self.failures = 0

    @property
    def in_outage(self) -> bool:
        return self._outage_started is not None
