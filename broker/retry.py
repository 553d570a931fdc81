"""RetryPolicy: which Redis failures a client waits out, and for how long it waits between tries.

A server that was never reached is a configuration problem: fail at once with a message that says
how to fix it (docs/reliability.md, scenario 9).
A server that answered before and then went away is an
outage: a reset, a timeout, a failover (`LOADING`, `MASTERDOWN`, `READONLY`...), a full pool or a
server at `maxclients` passes, so the client retries — submitting with the same request id (the
submit script makes that idempotent), following from the last entry id it handed over — until the
caller's own timeout. Everything else (refused credentials, a denied command, a wrong key type, out
of memory) is an answer, raised at once.
"""

from __future__ import annotations

import random
import time

import redis
import redis.exceptions

__all__ = ["Backoff", "RetryPolicy", "is_pool_exhausted", "is_refusal_to_wait_out",
           "is_transient"]

# Replies a server gives while it cannot serve for a moment (loading its data, a failover, a
# replica promoted, a script running too long, a cluster reconfiguring).
_TRANSIENT_REPLIES = ("LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "BUSY ",
                      "MOVED ", "ASK ", "max number of clients reached")
# Cluster states redis-py reports after its own redirects and retries ran out: a failover or a
# migrating slot that outlasted them, never a wrong command.
_CLUSTER_ERRORS = (redis.exceptions.ClusterError, redis.exceptions.TryAgainError,
                   redis.exceptions.AskError, redis.exceptions.SlotNotCoveredError)
DEFAULT_RETRY_TIMEOUT = 60.0  # seconds a call (not a follower: its own timeout) keeps retrying


def is_pool_exhausted(exc: BaseException) -> bool:
    """The client's own connection pool is full: a client-side limit, not a server problem."""
    return (isinstance(exc, redis.exceptions.MaxConnectionsError)
            or (isinstance(exc, redis.ConnectionError)
                and "No connection available" in str(exc)))


def is_transient(exc: BaseException, *, reached: bool) -> bool:
    """Whether waiting may cure `exc`; connection failures only once the server was reached."""
    if isinstance(exc, redis.AuthenticationError):
        return False
    text = str(exc)
    if is_pool_exhausted(exc) or isinstance(exc, _CLUSTER_ERRORS) \
            or any(reply in text for reply in _TRANSIENT_REPLIES):
        return True
    if isinstance(exc, redis.exceptions.OutOfMemoryError | redis.exceptions.NoPermissionError):
        return False
    return reached and isinstance(exc, redis.ConnectionError | redis.TimeoutError)


def is_refusal_to_wait_out(exc: BaseException) -> bool:
    """A command the server refused for now, found among a pipeline's replies: a cluster or
    failover state, out of memory (noeviction), or NOPERM while an ACL rollout is under way."""
    return (is_transient(exc, reached=True) or isinstance(
        exc, redis.exceptions.OutOfMemoryError | redis.exceptions.NoPermissionError))


class Backoff:
    """Capped exponential delays with jitter: 50 ms, 100 ms, ... 2 s."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def delay(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._next = self.first


class RetryPolicy:
    """Shared by a client and its result reader: whether the server was ever reached."""

    def __init__(self, retry_timeout: float | None = DEFAULT_RETRY_TIMEOUT) -> None:
        if retry_timeout is not None and retry_timeout < 0:
            raise ValueError(f"retry_timeout must be >= 0 or None, got {retry_timeout}")
        self.retry_timeout = retry_timeout
        self.reached = False

    def deadline(self) -> float | None:
        """The monotonic time a call that starts now stops retrying (None: never)."""
        return None if self.retry_timeout is None else time.monotonic() + self.retry_timeout

    def should_retry(self, exc: BaseException, deadline: float | None) -> bool:
        if not is_transient(exc, reached=self.reached):
            return False
        return deadline is None or time.monotonic() < deadline
