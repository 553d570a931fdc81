"""PoolMetrics and the deploy/ files: what Prometheus and Grafana get from the gateway.

The collector is fed heartbeats as workers write them; the Grafana dashboard and the Prometheus
config are checked against the series the gateway really exposes, so a renamed metric cannot
leave a panel silently empty.
"""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

from llmq.broker.commands import QueueStats
from llmq.gateway.metrics import GatewayMetrics
from llmq.protocol import LatencyHistogram, Timings, Usage, WorkerHeartbeat
from llmq.worker.heartbeat_counters import HeartbeatCounters
from tests.unit.worker_settings import ROOT


def heartbeat(worker_id: str, finished: list[tuple[str, Usage, Timings]]) -> WorkerHeartbeat:
    counters = HeartbeatCounters()
    counters.add_finished(finished, num_errors=1)
    beat = WorkerHeartbeat(worker_id=worker_id, queue="q", model="m", running=3, waiting=2,
                           kv_usage=0.5, generated_tokens_total=40, preemptions_total=2)
    return counters.fill(beat)


def scrape(metrics: GatewayMetrics) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


def test_each_worker_heartbeat_becomes_vllm_style_series_labelled_queue_worker_model():
    # Given two workers that finished requests: one after 0.2 s in the queue and 0.3 s to its
    # first token, one cut at its length
    done = ("stop", Usage(10, 20, 4), Timings(queue=0.2, ttft=0.5, e2e=2.0, per_token=0.05))
    cut = ("length", Usage(6, 8, 0), Timings(queue=0.1, ttft=0.2, e2e=1.0, per_token=0.04))
    metrics = GatewayMetrics()
    metrics.pool.update([heartbeat("w1", [done, cut]), heartbeat("w2", [done])],
                        [QueueStats("q", length=9, lag=4, pending=3, dead_letters=1,
                                    consumers=6, group_exists=True)])
    # When Prometheus scrapes the gateway
    samples = scrape(metrics)
    w1 = {("queue", "q"), ("worker", "w1"), ("model", "m")}

    def value(name: str, labels: set, **extra: str) -> float:
        return samples[(name, frozenset(labels | set(extra.items())))]

    # Then tokens, finish reasons and engine state are there per worker
    assert value("llmq_prompt_tokens_total", w1) == 16
    assert value("llmq_prefix_cache_hits_total", w1) == 4
    assert value("llmq_generation_tokens_total", w1) == 40
    assert value("llmq_requests_total", w1, finish_reason="length") == 1
    assert value("llmq_requests_total", w1, finish_reason="error") == 1
    assert value("llmq_num_preemptions_total", w1) == 2
    assert value("llmq_kv_cache_usage_ratio", w1) == 0.5
    assert value("llmq_num_requests_waiting", w1) == 2
    # And TTFT counts from the first schedule, queue time apart (0.3 s and 0.1 s)
    assert value("llmq_time_to_first_token_seconds_count", w1) == 2
    assert abs(value("llmq_time_to_first_token_seconds_sum", w1) - 0.4) < 1e-6
    assert value("llmq_time_to_first_token_seconds_bucket", w1, le="0.25") == 1
    assert value("llmq_time_to_first_token_seconds_bucket", w1, le="+Inf") == 2
    assert abs(value("llmq_request_queue_time_seconds_sum", w1) - 0.3) < 1e-6
    assert value("llmq_inter_token_latency_seconds_count", w1) == 2
    # And the queue's figures, with its live workers (not the group's 6 consumers)
    assert value("llmq_queue_lag", {("queue", "q")}) == 4
    assert value("llmq_queue_dead_letters", {("queue", "q")}) == 1
    assert value("llmq_queue_workers", {("queue", "q")}) == 2


def test_an_older_heartbeat_without_sums_reads_as_counts_only():
    # Given a histogram field as written before sums were carried
    histogram = LatencyHistogram.decode("1,2,0,0,0,0,0,0,0,0,0,0,0,0,0")
    # Then its counts are kept and its sum is 0
    assert histogram is not None and histogram.total == 3 and histogram.sum_s == 0.0


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_grafana_panel_queries_series_the_gateway_exposes():
    # Given the series a gateway with one worker and one queue exposes
    metrics = GatewayMetrics()
    metrics.pool.update([heartbeat("w1", [])], [QueueStats("q", 1, 1, 0, 0, 1, True)])
    exposed = {name for name, _ in scrape(metrics)}
    # Then every metric a panel names is among them, and every panel reads the gateway's job
    for expr in dashboard_exprs():
        for name in re.findall(r"\b(llmq_[a-z_]+)\b", expr):
            assert name in exposed, f"{name} (in {expr}) is not exposed"
        assert 'job="llmq-gateway"' in expr


def test_the_prometheus_config_scrapes_the_job_the_dashboard_reads():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["llmq-gateway"]["metrics_path"] == "/metrics"
    assert jobs["llmq-worker"]["static_configs"][0]["targets"] == ["localhost:9400",
                                                                    "localhost:9401"]
