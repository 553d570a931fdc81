"""Which Redis to talk to, how to connect, and how its failures read to a person.

`resolve_redis_url()` decides the URL: an explicit one, else `LLMQ_REDIS_URL`, else the embedded
server `llmq up` recorded under the run folder. `connect()` / `connect_async()` open clients with
timeouts that fail fast. `translate_errors()` turns redis-py's exceptions into `BrokerUnavailable`
and `BrokerError`, whose one-line messages say what to do, so the CLI never shows a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from llmq.broker.embedded import EmbeddedServer
from llmq.broker.redis_url import RedisURL, is_cluster
from llmq.broker.retry import is_pool_exhausted
from llmq.protocol.errors import BrokerError, BrokerUnavailable, LLMQError

__all__ = [
    "connect",
    "connect_async",
    "connect_at_most_once",
    "dedicated_connection",
    "is_cluster",
    "describe_connection",
    "redact_url",
    "resolve_redis_url",
    "translate",
    "translate_errors",
]

_FIX = "start one with `llmq up`, or point LLMQ_REDIS_URL / --redis-url at a running server"
# NOTE: blocking reads (XREAD BLOCK) are issued in slices shorter than this, so a socket timeout
# only fires when the server itself stops answering.
SOCKET_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0


def resolve_redis_url(url: str | None = None, *, run_dir: str | os.PathLike[str] | None = None
                      ) -> str:
    """The Redis URL to use: `url`, else LLMQ_REDIS_URL, else the running embedded server's.

    Raises BrokerUnavailable when none of them gives one.
    """
    if url:
        return url
    if env_url := os.environ.get("LLMQ_REDIS_URL", "").strip():
        return env_url
    if embedded_url := EmbeddedServer(run_dir).running_url():
        return embedded_url
    raise BrokerUnavailable(f"no Redis server configured and no embedded server running: {_FIX}")


def redact_url(url: str) -> str:
    """`url` without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rpartition("@")[2]
        user = f"{parts.username}:***@" if parts.username else "***@"
        return urlunsplit(parts._replace(netloc=user + netloc))
    except ValueError:
        return "<unparseable URL>"


def describe_connection(client: redis.Redis | redis.asyncio.Redis) -> str:
    """A URL-like description of a client made elsewhere, for error messages."""
    if is_cluster(client):
        nodes = ",".join(f"{n.host}:{n.port}" for n in client.get_nodes()[:3])
        return f"redis+cluster://{nodes}/"
    kwargs = client.connection_pool.connection_kwargs
    if path := kwargs.get("path"):
        return f"unix://{path}"
    scheme = "rediss" if "SSL" in client.connection_pool.connection_class.__name__ else "redis"
    host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
    return f"{scheme}://{host}:{port}/{kwargs.get('db', 0)}"


def _client_options(overrides: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": SOCKET_TIMEOUT,
        "health_check_interval": 30,
    }
    options.update(overrides)
    return options


# NOTE: the producer clients queue for a connection (BlockingConnectionPool) rather than fail
# with "Too many connections": 1,000 concurrent submits share these, and every followed result
# stream shares the reader's few connections (broker/multiplex.py).
DEFAULT_MAX_CONNECTIONS = 32
POOL_TIMEOUT = 20.0  # seconds a call waits for a free connection before it counts as a failure


def connect(url: str | None = None, *, max_connections: int | None = None,
            **options: Any) -> redis.Redis:
    """A redis-py client for `resolve_redis_url(url)`; bytes replies (msgpack needs them).

    A `redis+cluster://` URL gives a `RedisCluster`, a `redis+sentinel://` one a client of the
    current primary (see broker/redis_url.py). With `max_connections`, callers beyond that many
    wait for a free connection (a cluster client: that many per node).
    """
    url = resolve_redis_url(url)
    target = RedisURL.parse(url)
    try:
        if target.kind != "single":
            # NOTE: typed as the Redis it stands in for: a RedisCluster takes the same commands
            # (not a subclass, hence the ignore); code that needs its own API checks is_cluster().
            return target.client(  # type: ignore[return-value]
                _client_options(options), max_connections)
        if max_connections is None:
            return redis.Redis.from_url(url, **_client_options(options))
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_TIMEOUT,
            **_client_options(options))
        return redis.Redis.from_pool(pool)
    except (ValueError, redis.exceptions.RedisClusterException) as exc:
        # redis-py's complaint about a malformed URL, or no cluster node that answers
        raise BrokerUnavailable(f"invalid Redis URL {redact_url(url)}: {exc}") from None
    except redis.RedisError as exc:
        raise (translate(exc, url) or exc) from None


def connect_at_most_once(url: str | None, *, socket_timeout: float = 10.0) -> redis.Redis:
    """A client whose commands are each sent at most once: redis-py's own retries are off.

    For code that retries itself and knows what is safe to repeat (the worker's threads): a
    blindly repeated XADD would duplicate an event.
    """
    return connect(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2.0,
                   socket_timeout=socket_timeout)


def connect_async(url: str | None = None, *, max_connections: int | None = None,
                  **options: Any) -> redis.asyncio.Redis:
    """The asyncio counterpart of `connect()`."""
    url = resolve_redis_url(url)
    target = RedisURL.parse(url)
    try:
        if target.kind != "single":
            return target.async_client(_client_options(options), max_connections)
        if max_connections is None:
            return redis.asyncio.Redis.from_url(url, **_client_options(options))
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_TIMEOUT,
            **_client_options(options))
        return redis.asyncio.Redis.from_pool(pool)
    except (ValueError, redis.exceptions.RedisClusterException) as exc:
        raise BrokerUnavailable(f"invalid Redis URL {redact_url(url)}: {exc}") from None


def _reason(exc: BaseException) -> str:
    # redis-py says "Error 111 connecting to host:port. Connection refused." - keep the cause.
    text = str(exc).strip().rstrip(".")
    return text.rpartition(". ")[2] or type(exc).__name__


def translate(exc: BaseException, url: str) -> LLMQError | None:
    """The BrokerUnavailable / BrokerError a redis-py error reads as; None for other errors."""
    shown = redact_url(url)
    if isinstance(exc, redis.AuthenticationError):
        return BrokerUnavailable(
            f"Redis at {shown} refused the credentials ({exc}): check the user name and "
            "password in the URL")
    if is_pool_exhausted(exc):
        # NOTE: the client's own limit, not the server's: "no Redis server" would send people
        # looking for a server that is running.
        return BrokerUnavailable(
            f"every connection of this client's pool to {shown} stayed busy ({_reason(exc)}): "
            "too many calls at once for its max_connections; raise it, or share one client")
    if "max number of clients reached" in str(exc):
        return BrokerUnavailable(
            f"Redis at {shown} refuses new connections: it has `maxclients` open; raise "
            "maxclients, or use fewer clients")
    if isinstance(exc, redis.TimeoutError):
        return BrokerUnavailable(
            f"Redis at {shown} did not answer within {SOCKET_TIMEOUT:g}s: is it overloaded or "
            "paused?")
    if isinstance(exc, redis.ConnectionError):
        return BrokerUnavailable(f"no Redis server at {shown} ({_reason(exc)}): {_FIX}")
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return BrokerError(
            f"Redis at {shown} is out of memory and refuses writes ({exc}): let the workers "
            "drain the queue, or raise its maxmemory")
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return BrokerError(f"Redis at {shown} denied the command ({exc}): check the ACL "
                           "user's permissions")
    if isinstance(exc, redis.ResponseError):
        return BrokerError(f"Redis at {shown} returned an error: {exc}")
    return None


@contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Re-raise redis-py errors met inside the block as BrokerUnavailable / BrokerError."""
    try:
        yield
    except redis.RedisError as exc:
        translated = translate(exc, url)
        if translated is None:
            raise
        raise translated from None


def dedicated_connection(client: redis.Redis | redis.asyncio.Redis) -> Any:
    """A connection outside `client`'s pool, with its settings, for one long blocking read.

    No health-check PING (the read itself shows the link is alive) and no silent reconnect and
    resend: the reader decides what a failure means, and knows when its connection is new.
    """
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "health_check_interval": 0,
              "retry": Retry(NoBackoff(), 0)}
    return pool.connection_class(**kwargs)
