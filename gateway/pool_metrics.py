"""PoolMetrics: the whole pool's engine figures on the gateway's `/metrics`, from heartbeats.

Every worker writes cumulative counters and latency histograms into its heartbeat
(worker/heartbeat_counters.py, protocol/records.py); this collector turns the latest heartbeat
of each live worker into Prometheus series labelled `queue`, `worker` and `model`, so one
scrape of any gateway replica sees every worker, with no port per worker to discover. Names
and meanings follow vLLM's (`vllm:time_to_first_token_seconds` ->
`llmq_time_to_first_token_seconds`, ...), as the workers' own `/metrics` (worker/metrics.py)
do; the queues' depth, lag, pending entries and dead letters come from one XINFO per queue.

A worker that stops beating drops out with its series (its counters end with it, as a
restarted vLLM's do); `sum(rate(...))` over the pool stays right. Histograms use the
heartbeats' fixed bounds (protocol/latency_histogram.py, 10 ms to 10 min).

References: vLLM `v1/metrics/loggers.py`; prometheus-client's custom collectors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from llmq.broker.aio import AsyncClient
from llmq.broker.commands import QueueStats
from llmq.protocol import TTFT_BUCKETS_MS, LatencyHistogram, WorkerHeartbeat

__all__ = ["PoolMetrics"]

_LABELS = ("queue", "worker", "model")
_FINISH_REASONS = ("stop", "length", "cancelled", "error")

# (name, help, heartbeat field): counters, gauges and histograms read off each heartbeat.
_COUNTERS: tuple[tuple[str, str, Callable[[WorkerHeartbeat], float]], ...] = (
    ("llmq_prompt_tokens", "Prompt tokens of finished requests (vllm:prompt_tokens).",
     lambda b: b.prompt_tokens_total),
    ("llmq_generation_tokens", "Generated tokens (vllm:generation_tokens).",
     lambda b: b.generated_tokens_total),
    ("llmq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
     "(vllm:prefix_cache_queries).", lambda b: b.prompt_tokens_total),
    ("llmq_prefix_cache_hits", "Prompt tokens served from the prefix cache "
     "(vllm:prefix_cache_hits).", lambda b: b.cached_prompt_tokens_total),
    ("llmq_num_preemptions", "Requests preempted for lack of KV blocks "
     "(vllm:num_preemptions).", lambda b: b.preemptions_total),
)
_GAUGES: tuple[tuple[str, str, Callable[[WorkerHeartbeat], float]], ...] = (
    ("llmq_num_requests_running", "Requests in the running batch (vllm:num_requests_running).",
     lambda b: b.running),
    ("llmq_num_requests_waiting", "Requests admitted and not yet scheduled "
     "(vllm:num_requests_waiting).", lambda b: b.waiting),
    ("llmq_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use, 0-1 "
     "(vllm:kv_cache_usage_perc).", lambda b: b.kv_usage),
    ("llmq_prefix_cache_hit_ratio", "Recent prefix-cache hit rate, 0-1.",
     lambda b: b.prefix_cache_hit_rate),
    ("llmq_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
     lambda b: max(0.0, time.time() - b.heartbeat_ms / 1000)),
)
_HISTOGRAMS: tuple[tuple[str, str, Callable[[WorkerHeartbeat], str]], ...] = (
    ("llmq_request_queue_time_seconds", "Arrival in the queue stream to first scheduled "
     "(vllm:request_queue_time_seconds).", lambda b: b.queue_hist),
    ("llmq_time_to_first_token_seconds", "First scheduled to first token: TTFT after "
     "admission, queue time apart (vllm:time_to_first_token_seconds).",
     lambda b: b.ttft_admitted_hist),
    ("llmq_inter_token_latency_seconds", "Mean gap between output tokens, one observation per "
     "request (vllm:inter_token_latency_seconds).", lambda b: b.itl_hist),
    ("llmq_e2e_request_latency_seconds", "Arrival in the queue stream to the terminal event "
     "(vllm:e2e_request_latency_seconds).", lambda b: b.e2e_hist),
)
_QUEUE_GAUGES: tuple[tuple[str, str, Callable[[QueueStats], float]], ...] = (
    ("llmq_queue_length", "Entries in the request stream.", lambda s: s.length),
    ("llmq_queue_lag", "Entries no worker has read yet.",
     lambda s: s.lag if s.lag is not None else max(0, s.length - s.pending)),
    ("llmq_queue_pending", "Entries read by a worker and not yet acknowledged.",
     lambda s: s.pending),
    ("llmq_queue_dead_letters", "Entries in the queue's dead-letter stream.",
     lambda s: s.dead_letters),
)


def _buckets(histogram: LatencyHistogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs, Prometheus' form, ending with +Inf."""
    pairs, seen = [], 0
    for bound_ms, count in zip(TTFT_BUCKETS_MS, histogram.counts, strict=False):
        seen += count
        pairs.append((repr(bound_ms / 1000), float(seen)))
    pairs.append(("+Inf", float(histogram.total)))
    return pairs


class PoolMetrics(Collector):
    """Collects from the last `refresh()`: the gateway's `/metrics` refreshes, then renders."""

    def __init__(self) -> None:
        self._workers: list[WorkerHeartbeat] = []
        self._queues: list[QueueStats] = []

    async def refresh(self, client: AsyncClient, workers: list[WorkerHeartbeat],
                      queues: list[str]) -> None:
        self.update(workers, [await client.stats(queue) for queue in sorted(set(queues))])

    def update(self, workers: list[WorkerHeartbeat], queues: list[QueueStats]) -> None:
        """What the next scrape shows: these heartbeats and queue figures."""
        self._workers, self._queues = workers, queues

    def collect(self) -> Iterator[Metric]:
        beats = self._workers
        for name, doc, read in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            for b in beats:
                counter.add_metric([b.queue, b.worker_id, b.model], float(read(b)))
            yield counter
        requests = CounterMetricFamily(
            "llmq_requests", "Requests finished, by finish reason (vllm:request_success).",
            labels=(*_LABELS, "finish_reason"))
        for b in beats:
            for reason in _FINISH_REASONS:
                requests.add_metric([b.queue, b.worker_id, b.model, reason],
                                    float(getattr(b, f"finished_{reason}_total")))
        yield requests
        for name, doc, read in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            for b in beats:
                gauge.add_metric([b.queue, b.worker_id, b.model], float(read(b)))
            yield gauge
        for name, doc, field in _HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=_LABELS)
            for b in beats:
                histogram = LatencyHistogram.decode(field(b)) or LatencyHistogram()
                family.add_metric([b.queue, b.worker_id, b.model], _buckets(histogram),
                                  histogram.sum_s)
            yield family
        for name, doc, read_stats in _QUEUE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=("queue",))
            for stats in self._queues:
                gauge.add_metric([stats.queue], float(read_stats(stats)))
            yield gauge
        consumers = GaugeMetricFamily("llmq_queue_workers",
                                      "Live workers (with a heartbeat) serving the queue.",
                                      labels=("queue",))
        for stats in self._queues:
            consumers.add_metric([stats.queue],
                                 float(sum(1 for b in beats if b.queue == stats.queue)))
        yield consumers
