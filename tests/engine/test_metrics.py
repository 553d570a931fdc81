"""WorkerMetrics and HealthServer: what Prometheus and Kubernetes see when they ask a worker.

Every test talks HTTP to a live HealthServer on a free loopback port, the way a scraper or a
kubelet probe does. The liveness clock is injected, so no test sleeps or depends on timing.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmq.worker.health_server import HealthServer
from llmq.worker.metrics import WorkerMetrics

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUEUE = "default"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics() -> WorkerMetrics:
    return WorkerMetrics(model=MODEL, queue=QUEUE)


@pytest.fixture
def server(metrics: WorkerMetrics, clock: FakeClock):
    with HealthServer(0, metrics, host="127.0.0.1", liveness_timeout=10.0, clock=clock) as srv:
        yield srv


def get(server: HealthServer, path: str) -> tuple[int, str, str]:
    """GET a path; return (status, content type, body) whatever the status."""
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def scrape(server: HealthServer) -> dict[tuple[str, frozenset], float]:
    """Scrape /metrics and index every sample by (name, labels)."""
    status, content_type, body = get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


LABELS = frozenset({("model", MODEL), ("queue", QUEUE)})


def value(samples, name: str, **extra: str) -> float:
    return samples[(name, LABELS | frozenset(extra.items()))]


def test_scrape_after_requests_shows_request_token_and_latency_series(server, metrics):
    # Given a worker that finished two requests, failed one and ran steps
    metrics.observe_finished("stop", None, prompt_tokens=12, completion_tokens=30,
                             cached_prompt_tokens=8, queue_s=0.2, ttft_s=0.35, e2e_s=1.9,
                             per_token_s=0.05)
    metrics.observe_finished("length", None, prompt_tokens=5, completion_tokens=16,
                             cached_prompt_tokens=0, queue_s=0.1, ttft_s=0.2, e2e_s=1.0,
                             per_token_s=0.04)
    metrics.observe_finished("error", "prompt_too_long", prompt_tokens=9000, completion_tokens=0,
                             cached_prompt_tokens=0, queue_s=0.05, ttft_s=None, e2e_s=0.06,
                             per_token_s=None)
    metrics.observe_step(0.02, num_tokens=40)
    metrics.set_engine_state(running=3, waiting=2, kv_cache_usage=0.25,
                             prefix_cache_hit_rate=0.4, num_preemptions_total=1)
    metrics.inc_reclaimed(2)
    metrics.inc_dead_letters()

    # When Prometheus scrapes /metrics
    samples = scrape(server)

    # Then every series the operations guide names carries the worker's numbers
    assert value(samples, "llmq_requests_total", finish_reason="stop", error_code="") == 1
    assert value(samples, "llmq_requests_total", finish_reason="length", error_code="") == 1
    assert value(samples, "llmq_requests_total", finish_reason="error",
                 error_code="prompt_too_long") == 1
    assert value(samples, "llmq_prompt_tokens_total") == 12 + 5 + 9000
    assert value(samples, "llmq_prompt_tokens_cached_total") == 8
    assert value(samples, "llmq_generation_tokens_total") == 46
    # The failed request never produced a token: two TTFT observations, three e2e ones; TTFT
    # counts from the first schedule, the queue time apart (0.35 - 0.2 and 0.2 - 0.1).
    assert value(samples, "llmq_time_to_first_token_seconds_count") == 2
    assert value(samples, "llmq_time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert value(samples, "llmq_inter_token_latency_seconds_count") == 2
    assert value(samples, "llmq_request_queue_time_seconds_count") == 3
    assert value(samples, "llmq_e2e_request_latency_seconds_count") == 3
    assert value(samples, "llmq_step_duration_seconds_count") == 1
    assert value(samples, "llmq_step_tokens_sum") == 40
    assert value(samples, "llmq_num_requests_running") == 3
    assert value(samples, "llmq_num_requests_waiting") == 2
    assert value(samples, "llmq_kv_cache_usage_ratio") == 0.25
    assert value(samples, "llmq_prefix_cache_hit_ratio") == 0.4
    assert value(samples, "llmq_num_preemptions_total") == 1
    assert value(samples, "llmq_reclaimed_requests_total") == 2
    assert value(samples, "llmq_dead_letters_total") == 1
    # And the process itself is measured (pods are sized by its resident memory)
    assert samples[("process_resident_memory_bytes", frozenset())] > 0


def test_histogram_buckets_reach_from_milliseconds_to_minutes(server, metrics):
    # Given a request that waited 3 minutes in the queue on a busy CPU pool
    metrics.observe_finished("stop", None, 10, 10, 0, queue_s=180.0, ttft_s=181.0, e2e_s=190.0,
                             per_token_s=0.9)
    # When scraped
    samples = scrape(server)
    # Then it lands in a finite bucket, not only in +Inf, and a 3 ms one would not have
    assert value(samples, "llmq_request_queue_time_seconds_bucket", le="320.0") == 1
    assert value(samples, "llmq_request_queue_time_seconds_bucket", le="160.0") == 0
    assert value(samples, "llmq_request_queue_time_seconds_bucket", le="0.005") == 0


def test_every_series_exists_at_zero_before_any_request(server):
    # Given a worker that has served nothing yet
    # When scraped
    samples = scrape(server)
    # Then the series are already there, so rate() and alerts see zero rather than no data
    assert value(samples, "llmq_requests_total", finish_reason="stop", error_code="") == 0
    assert value(samples, "llmq_generation_tokens_total") == 0
    assert value(samples, "llmq_time_to_first_token_seconds_count") == 0
    assert value(samples, "llmq_num_requests_running") == 0
    assert value(samples, "llmq_dead_letters_total") == 0


def test_preemptions_follow_the_engines_running_total(server, metrics):
    # Given an engine that reports its cumulative preemption count every step
    for total in (0, 2, 2, 5):
        metrics.set_engine_state(1, 0, 0.9, 0.0, num_preemptions_total=total)
    assert value(scrape(server), "llmq_num_preemptions_total") == 5
    # When the engine is rebuilt and its count starts over
    metrics.set_engine_state(1, 0, 0.9, 0.0, num_preemptions_total=1)
    metrics.set_engine_state(1, 0, 0.9, 0.0, num_preemptions_total=3)
    # Then the counter never goes back and counts the new engine's preemptions from its restart
    assert value(scrape(server), "llmq_num_preemptions_total") == 7


def test_two_workers_in_one_process_keep_separate_series():
    # Given two workers on different queues in one process (tests, `llmq up`)
    a = WorkerMetrics(model=MODEL, queue="a")
    b = WorkerMetrics(model=MODEL, queue="b")
    # When only one of them serves a request
    a.inc_dead_letters(3)
    # Then the other's numbers are untouched
    assert a.registry.get_sample_value(
        "llmq_dead_letters_total", {"model": MODEL, "queue": "a"}) == 3
    assert b.registry.get_sample_value(
        "llmq_dead_letters_total", {"model": MODEL, "queue": "b"}) == 0


def test_healthz_fails_until_the_loop_beats_and_again_when_it_wedges(server, clock):
    # Given a worker still loading its model: the busy loop has not started
    status, _, body = get(server, "/healthz")
    assert (status, body) == (503, "busy loop has not started\n")
    # When the loop beats
    server.beat()
    # Then liveness passes, and keeps passing up to the timeout
    assert get(server, "/healthz")[0] == 200
    clock.now += 10.0
    assert get(server, "/healthz")[0] == 200
    # When the loop stops beating past liveness_timeout (a wedged step)
    clock.now += 0.5
    status, _, body = get(server, "/healthz")
    # Then the kubelet sees 503 and why
    assert status == 503
    assert "busy loop silent for 10.5s" in body
    # And a loop that recovers is live again
    server.beat()
    assert get(server, "/healthz")[0] == 200


def test_readyz_follows_loading_serving_and_draining(server, clock):
    # Given a worker whose loop runs but whose model is not loaded yet
    server.beat()
    status, _, body = get(server, "/readyz")
    assert (status, body) == (503, "starting: model not loaded\n")
    # When it is loaded, warmed up and connected to Redis
    server.set_ready(True)
    # Then it is ready
    assert get(server, "/readyz")[:1] == (200,)
    # When Redis goes away, the worker says so and readiness fails with its reason
    server.set_ready(False, "redis unreachable")
    assert get(server, "/readyz")[0::2] == (503, "redis unreachable\n")
    server.set_ready(True)
    assert get(server, "/readyz")[0] == 200
    # When SIGTERM starts the drain
    server.set_draining()
    # Then readiness fails for good, while liveness still follows the loop
    assert get(server, "/readyz")[0::2] == (503, "draining\n")
    server.set_ready(True)
    assert get(server, "/readyz")[0] == 503
    assert get(server, "/healthz")[0] == 200


def test_readyz_fails_when_the_loop_is_wedged_even_if_flagged_ready(server, clock):
    # Given a ready worker
    server.beat()
    server.set_ready(True)
    # When its loop stops beating
    clock.now += 60
    # Then it is no longer ready either
    status, _, body = get(server, "/readyz")
    assert status == 503
    assert body.startswith("busy loop silent")


def test_port_zero_picks_distinct_free_ports_and_unknown_paths_are_404(metrics):
    # Given two health servers asked for port 0
    with HealthServer(0, metrics, host="127.0.0.1") as a, \
            HealthServer(0, WorkerMetrics(MODEL, QUEUE), host="127.0.0.1") as b:
        # Then each got a real port of its own
        assert a.port > 0 and b.port > 0 and a.port != b.port
        # And a typo'd probe path is a 404 that names the real ones
        status, _, body = get(a, "/health")
        assert status == 404 and "/healthz" in body


def test_stop_releases_the_port(metrics):
    # Given a running server
    srv = HealthServer(0, metrics, host="127.0.0.1")
    port = srv.port
    # When it is stopped
    srv.stop()
    # Then nothing answers on its port any more
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_paused_and_dropped_steps_follow_the_engines_running_totals(server, metrics):
    # Given an engine whose batch steps paused 3 times for interactive arrivals, one dropped
    metrics.set_step_pauses(num_paused_total=1, num_dropped_total=0)
    metrics.set_step_pauses(num_paused_total=3, num_dropped_total=1)
    samples = scrape(server)
    assert value(samples, "llmq_steps_paused_total") == 3
    assert value(samples, "llmq_steps_dropped_total") == 1
    # When the engine is rebuilt and its counts start over
    metrics.set_step_pauses(num_paused_total=1, num_dropped_total=0)
    metrics.set_step_pauses(num_paused_total=3, num_dropped_total=0)
    # Then the counters never go back and count the new engine's pauses from its restart
    assert value(scrape(server), "llmq_steps_paused_total") == 5
    assert value(scrape(server), "llmq_steps_dropped_total") == 1
