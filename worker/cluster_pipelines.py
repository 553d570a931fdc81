"""Per-node pipelines: the result writer's event writes on a Redis Cluster, grouped by node.

NOTE: redis-py's cluster pipeline costs several times a plain one in Python (measured by
bench/broker.py: the writer fell behind at half the single-node rate). So the result writer
(worker/result_writer.py) queues a batch's event commands on a `CommandRecorder`, and
`send_per_node` sends each node's share in one plain pipeline on that node's own connection;
what a node refuses with MOVED or ASK (a slot on the move) is sent again, in order, through the
cluster client, which follows redirects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from llmq.worker.backoff import TRANSIENT_ERRORS

__all__ = ["Call", "CommandRecorder", "send_per_node"]

# One queued command: (redis-py method name, args, kwargs); args[0] is the key.
Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class CommandRecorder:
    """Stands in for a pipeline: records the commands queued on it, to group them by node."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def send_per_node(client: RedisCluster, calls: list[Call],
                  check: Callable[[list[Any]], None]) -> None:
    """Send `calls`, each node's in one plain pipeline, then the redirected ones through the
    cluster client. `check` sees every pipeline's replies (bar the redirects) and raises to stop
    there; a connection lost to a node makes the client learn the slot map again and raises."""
    by_node: dict[str, tuple[ClusterNode, list[Call]]] = {}
    for call in calls:
        node = client.get_node_from_key(call[1][0])
        by_node.setdefault(node.name, (node, []))[1].append(call)
    redirected: list[Call] = []
    for node, node_calls in by_node.values():
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        _queue(pipe, node_calls)
        try:
            results = pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS:
            client.nodes_manager.initialize()  # a failover: learn the new map
            raise
        redirected += [c for c, r in zip(node_calls, results, strict=True) if _redirect(r)]
        check([r for r in results if not _redirect(r)])
    if redirected:
        cluster_pipe = client.pipeline(transaction=False)
        _queue(cluster_pipe, redirected)
        check(cluster_pipe.execute(raise_on_error=False))


def _queue(pipe: Any, calls: list[Call]) -> None:
    for name, args, kwargs in calls:
        getattr(pipe, name)(*args, **kwargs)


def _redirect(result: Any) -> bool:
    return isinstance(result, redis.ResponseError) and str(result).startswith(("MOVED", "ASK"))
