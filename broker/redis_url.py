"""RedisURL: which kind of Redis deployment a URL names, and the redis-py client for it.

Three forms, one setting (`LLMQ_REDIS_URL`, `--redis-url`) for every component:

    redis://[user:pass@]host:port[/db]    rediss://... (TLS)   unix:///path/to/redis.sock
        one server (redis-py's `Redis.from_url`, every option it reads)
    redis+cluster://[user:pass@]host:port[,host:port...][/]    rediss+cluster://... (TLS)
        a Redis Cluster: any reachable nodes seed the slot map (`RedisCluster`)
    redis+sentinel://[user:pass@]host:port[,host:port...]/master_name[/db]    rediss+sentinel://
        Sentinel: the sentinels are asked for the current primary of `master_name`, and again
        after a failover. `user:pass` authenticate to the primary; sentinels that want their own
        password get `?sentinel_password=...` (and `sentinel_username=`).

The key schema is the same for all three (broker/keys.py): nothing else changes with the form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from llmq.protocol.errors import BrokerUnavailable

__all__ = ["CLUSTER_SCHEMES", "SENTINEL_SCHEMES", "RedisURL", "cluster_client", "is_cluster",
           "primary_address"]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
Kind = Literal["single", "cluster", "sentinel"]
_DEFAULT_PORTS = {"cluster": 6379, "sentinel": 26379}
# redis-py's default for a cluster client's per-node pool.
CLUSTER_MAX_CONNECTIONS = 100


@dataclass(frozen=True)
class RedisURL:
    url: str
    kind: Kind
    nodes: list[tuple[str, int]] = field(default_factory=list)
    username: str | None = None
    password: str | None = None
    tls: bool = False
    master_name: str | None = None
    db: int = 0
    sentinel_auth: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> RedisURL:
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise _invalid(url, "no scheme (redis://, redis+cluster://, redis+sentinel://...)")
        scheme = scheme.lower()
        kind: Kind
        if scheme in CLUSTER_SCHEMES:
            kind = "cluster"
        elif scheme in SENTINEL_SCHEMES:
            kind = "sentinel"
        else:
            try:
                parts = urlsplit(url)
                nodes = [(parts.hostname, parts.port or 6379)] if parts.hostname else []
                return cls(url, "single", nodes, unquote(parts.username or "") or None,
                           None if parts.password is None else unquote(parts.password),
                           scheme == "rediss")
            except ValueError as exc:
                raise _invalid(url, str(exc)) from None
        rest, _, query = rest.partition("?")
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        if not at:
            hosts, userinfo = netloc, ""
        username = password = None
        if userinfo:
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        nodes = [_host_port(url, part, _DEFAULT_PORTS[kind]) for part in hosts.split(",")
                 if part.strip()]
        if not nodes:
            raise _invalid(url, "no host:port")
        segments = [p for p in path.split("/") if p]
        master_name, db = None, 0
        if kind == "sentinel":
            if not segments:
                raise _invalid(url, "no master name: redis+sentinel://host:port,.../mymaster")
            master_name = unquote(segments.pop(0))
        if segments:
            try:
                db = int(segments[0])
            except ValueError:
                raise _invalid(url, f"{segments[0]!r} is not a database number") from None
            if kind == "cluster" and db:
                raise _invalid(url, "a Redis Cluster has only database 0")
        params = {k: v[-1] for k, v in parse_qs(query).items()}
        sentinel_auth = {k.removeprefix("sentinel_"): v for k, v in params.items()
                         if k in ("sentinel_username", "sentinel_password")}
        return cls(url, kind, nodes, username, password, scheme.startswith("rediss"),
                   master_name, db, sentinel_auth)

    # -- clients ----------------------------------------------------------------------------------

    def _auth(self) -> dict[str, Any]:
        auth: dict[str, Any] = {}
        if self.username:
            auth["username"] = self.username
        if self.password is not None:
            auth["password"] = self.password
        if self.tls:
            auth["ssl"] = True
        return auth

    def client(self, options: dict[str, Any], max_connections: int | None
               ) -> redis.Redis | redis.cluster.RedisCluster:
        """A sync client for this deployment (a single server's is made by the caller)."""
        assert self.kind != "single"
        if self.kind == "cluster":
            retry = options.pop("retry", None)
            options.pop("health_check_interval", None)
            return redis.cluster.RedisCluster(
                startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in self.nodes],
                max_connections=max_connections or CLUSTER_MAX_CONNECTIONS,
                **({"retry": retry} if retry is not None else {}), **self._auth(), **options)
        sentinel = redis.sentinel.Sentinel(
            self.nodes, sentinel_kwargs={**self._sentinel_options(options)}, **self._ssl())
        if max_connections:
            options["max_connections"] = max_connections
        return sentinel.master_for(self._master(), db=self.db, **self._auth(), **options)

    def async_client(self, options: dict[str, Any], max_connections: int | None) -> Any:
        """The asyncio counterpart of `client()`."""
        assert self.kind != "single"
        if self.kind == "cluster":
            retry = options.pop("retry", None)
            options.pop("health_check_interval", None)
            return redis.asyncio.cluster.RedisCluster(
                startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in self.nodes],
                max_connections=max_connections or CLUSTER_MAX_CONNECTIONS,
                **({"retry": retry} if retry is not None else {}), **self._auth(), **options)
        sentinel = redis.asyncio.sentinel.Sentinel(
            self.nodes, sentinel_kwargs={**self._sentinel_options(options)}, **self._ssl())
        if max_connections:
            options["max_connections"] = max_connections
        return sentinel.master_for(self._master(), db=self.db, **self._auth(), **options)

    def _master(self) -> str:
        if self.master_name is None:  # parse() makes no sentinel URL without one
            raise _invalid(self.url, "no master name")
        return self.master_name

    def _ssl(self) -> dict[str, Any]:
        return {"ssl": True} if self.tls else {}

    def _sentinel_options(self, options: dict[str, Any]) -> dict[str, Any]:
        timeouts: dict[str, Any] = {
            k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}
        return {**timeouts, **self._ssl(), **self.sentinel_auth}


def is_cluster(client: object
               ) -> TypeGuard[redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster]:
    """Whether `client` talks to a Redis Cluster (sync or asyncio)."""
    return isinstance(client, redis.cluster.RedisCluster | redis.asyncio.cluster.RedisCluster)


def cluster_client(client: object) -> redis.cluster.RedisCluster | None:
    """`client` as the sync Redis Cluster client it is, for the cluster's own API (nodes, slots);
    None for any other client.

    NOTE: `connect()` types every client as `redis.Redis`, which a RedisCluster is not a subclass
    of: an isinstance check on such a variable reads to a type checker as a branch that cannot
    run (and is then not checked). This one takes `object`, so the branch is checked.
    """
    return client if isinstance(client, redis.cluster.RedisCluster) else None


def primary_address(client: Any) -> str | None:
    """`host:port` of the primary a Sentinel-managed client follows now; None for other kinds."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, redis.sentinel.SentinelConnectionPool):
        return None
    host, port = pool.get_master_address()
    return f"{host}:{port}"


def _host_port(url: str, text: str, default_port: int) -> tuple[str, int]:
    host, colon, port = text.strip().rpartition(":")
    if not colon:
        return text.strip(), default_port
    host = host.strip("[]")
    try:
        return host, int(port)
    except ValueError:
        raise _invalid(url, f"{text!r} is not host:port") from None


def _invalid(url: str, why: str) -> BrokerUnavailable:
    from llmq.broker.connection import redact_url

    return BrokerUnavailable(f"invalid Redis URL {redact_url(url)}: {why}")
