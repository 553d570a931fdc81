"""GatewayMetrics: the Prometheus series `llmq serve` exposes on `/metrics`.

The pool's own figures (every worker's engine series, every queue's depth) are collected into the
same registry by `PoolMetrics` (gateway/pool_metrics.py), read fresh on each scrape.

Requests by route and HTTP status, their latency (until the response is complete, streams
included), the streams open now, and the process's CPU and memory (the figures to size the
gateway's replicas and its HPA by). Routes are the templates (`/v1/batches/{batch_id}`), never raw
paths, so ids cannot blow up the label set. One registry per app, as the worker does.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.process_collector import ProcessCollector

from llmq.gateway.pool_metrics import PoolMetrics

__all__ = ["GatewayMetrics"]

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            300.0, 600.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = Counter("llmq_gateway_requests", "HTTP requests answered.",
                                ("method", "route", "status"), registry=self.registry)
        self.latency = Histogram("llmq_gateway_request_duration_seconds",
                                 "Request received to response complete (streams included).",
                                 ("method", "route"), buckets=_BUCKETS, registry=self.registry)
        self.open_streams = Gauge("llmq_gateway_open_streams",
                                  "Server-sent event streams open now.", registry=self.registry)
        self.cancelled = Counter("llmq_gateway_disconnect_cancels",
                                 "Requests cancelled because their client went away.",
                                 registry=self.registry)
        self.errors = Counter("llmq_gateway_errors", "Error responses, by status class.",
                              ("status_class",), registry=self.registry)
        for status_class in ("4xx", "5xx"):
            self.errors.labels(status_class)  # every series from the first scrape
        self.pool = PoolMetrics()
        self.registry.register(self.pool)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        if status >= 400:
            self.errors.labels(f"{status // 100}xx").inc()
        self.latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
