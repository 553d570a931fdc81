"""The dashboard's pieces that need neither Redis nor a browser: who sees what, the TTFT
histogram heartbeats carry, and how the gateway turns heartbeats into chart samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmq.broker.keys import Keys
from llmq.gateway.api_keys import ApiKeys
from llmq.gateway.dashboard_session import Viewer
from llmq.gateway.errors import APIError
from llmq.gateway.pool_series import PoolSeries
from llmq.protocol import (
    TTFT_BUCKETS_MS,
    LatencyHistogram,
    WorkerHeartbeat,
    decode_heartbeat,
    encode_heartbeat,
)

# -- who sees what ---------------------------------------------------------------------------------


def test_admin_tenants_are_named_by_flag_and_must_have_a_key() -> None:
    keys = ApiKeys.parse(["alice=sk-a, ops=sk-o"], admin_tenants=["ops"])
    assert keys.is_admin("ops") and not keys.is_admin("alice")
    assert keys.tenant_of_digest(ApiKeys.digest("sk-o")) == "ops"
    with pytest.raises(ValueError, match="nobody"):
        ApiKeys.parse(["alice=sk-a"], admin_tenants=["nobody"])
    # A gateway without keys is on a trusted network: its one tenant is an admin
    assert ApiKeys(anonymous=True).is_admin("default")


def test_a_tenant_reaches_only_its_own_request_ids_and_an_admin_any() -> None:
    alice = Viewer("alice", admin=False, csrf_token="t", by_cookie=True)
    ops = Viewer("ops", admin=True, csrf_token="t", by_cookie=True)
    # What alice types is inside her own namespace, whatever she types
    assert alice.request_id("story-1") == "alice:story-1"
    assert alice.request_id("bob:story-1") == "alice:bob:story-1"
    assert ops.request_id("bob:story-1") == "bob:story-1"
    assert alice.owns("alice:x") and not alice.owns("bob:x") and not alice.owns(None)
    assert ops.owns("bob:x") and ops.owns(None)
    assert alice.shown_id("alice:x") == "x" and ops.shown_id("alice:x") == "alice:x"
    with pytest.raises(APIError):
        alice.request_id("no spaces allowed")


# -- the TTFT histogram ----------------------------------------------------------------------------


def test_ttft_percentiles_come_from_bucket_counts_that_add_across_workers() -> None:
    # Given two workers: one answered 90 requests in ~40 ms, the other 10 in ~4 s
    fast, slow = LatencyHistogram(), LatencyHistogram()
    for _ in range(90):
        fast.observe(0.040)
    for _ in range(10):
        slow.observe(4.0)
    pool = LatencyHistogram.merged([fast, slow])
    # Then the pool's median lies in the 25-50 ms bucket and its p95 in the 2.5-5 s one
    assert 25 < pool.quantile(0.5) <= 50
    assert 2_500 < pool.quantile(0.95) <= 5_000
    assert LatencyHistogram().quantile(0.5) is None


def test_a_histogram_travels_as_text_and_a_restarted_worker_counts_whole() -> None:
    h = LatencyHistogram()
    h.observe(0.001)
    h.observe(1e6)  # above the last bound
    assert LatencyHistogram.decode(h.encode()).counts == h.counts
    assert len(h.counts) == len(TTFT_BUCKETS_MS) + 1 and h.counts[0] == h.counts[-1] == 1
    assert LatencyHistogram.decode("") is None and LatencyHistogram.decode("1,x") is None
    later = LatencyHistogram(h.counts)
    later.observe(0.3)
    assert later.since(h).total == 1
    assert h.since(later).total == 2  # counts went down: a new process, counted whole


def test_heartbeats_from_before_the_counters_still_decode() -> None:
    old = {"worker_id": "w", "queue": "default", "model": "m", "tokens_per_s": "3.5"}
    beat = decode_heartbeat(old)
    assert beat.requests_total == 0 and beat.ttft_hist == "" and beat.draining == 0
    new = WorkerHeartbeat(worker_id="w", queue="q", requests_total=7, ttft_hist="1,2")
    assert decode_heartbeat(encode_heartbeat(new)) == new


# -- chart samples from heartbeats -----------------------------------------------------------------


def _series(interval: float = 10.0) -> PoolSeries:
    series = PoolSeries(SimpleNamespace(keys=Keys()), None, interval)  # type: ignore[arg-type]
    series._watching_since_ms = 1_000_000
    return series


def _beat(worker_id: str, at_ms: int, requests: int, tokens: int, *, queue: str = "default",
          started_ms: int = 0, ttfts: tuple[float, ...] = (), queued: tuple[float, ...] = (),
          kv_usage: float = 0.0, preemptions: int = 0) -> WorkerHeartbeat:
    hist, queue_hist = LatencyHistogram(), LatencyHistogram()
    for ttft in ttfts:
        hist.observe(ttft)
    for seconds in queued:
        queue_hist.observe(seconds)
    return WorkerHeartbeat(worker_id=worker_id, queue=queue, started_ms=started_ms,
                           heartbeat_ms=at_ms, requests_total=requests,
                           generated_tokens_total=tokens,
                           ttft_admitted_hist=hist.encode(with_sum=True),
                           queue_hist=queue_hist.encode(with_sum=True), kv_usage=kv_usage,
                           preemptions_total=preemptions)


def test_rates_are_counter_differences_between_heartbeats_summed_by_queue() -> None:
    series = _series()
    # Given two workers on default and one on batch, seen once (their totals predate us)
    series.observe([_beat("a", 1_000_000, 100, 5_000), _beat("b", 1_000_000, 10, 100),
                    _beat("c", 1_000_000, 0, 0, queue="batch")])
    assert series.sample(1_000_000, lag=0).tokens_per_s == 0
    # When each beats again 2 s later
    series.observe([_beat("a", 1_002_000, 104, 5_200), _beat("b", 1_002_000, 12, 160),
                    _beat("c", 1_002_000, 1, 50, queue="batch")])
    # Then the rates are the counters' growth over 2 s, per queue and for the pool
    rates = series.rates()
    assert (rates["default"].requests_per_s, rates["default"].tokens_per_s) == (3.0, 130.0)
    assert (rates["batch"].requests_per_s, rates["batch"].tokens_per_s) == (0.5, 25.0)
    sample = series.sample(1_002_345, lag=7)
    assert (sample.t, sample.tokens_per_s, sample.requests_per_s, sample.lag) == \
        (1_000_000, 155.0, 3.5, 7)
    # And a heartbeat seen again changes nothing, a worker gone leaves the sums
    series.observe([_beat("a", 1_002_000, 104, 5_200)])
    assert series.rates()["default"].tokens_per_s == 100.0 and "batch" not in series.rates()


def test_a_new_worker_counts_from_its_start_and_a_restarted_one_from_zero() -> None:
    series = _series()
    # A worker that started after the gateway began watching: all its counts are new
    series.observe([_beat("new", 1_004_000, 8, 400, started_ms=1_002_000)])
    assert series.rates()["default"].tokens_per_s == 200.0
    # The same id restarted: its counters went down, what it reports now is new
    series.observe([_beat("new", 1_006_000, 2, 100, started_ms=1_005_000)])
    assert series.rates()["default"].tokens_per_s == 50.0


def test_ttft_points_cover_the_requests_of_the_last_minute_over_every_worker() -> None:
    series = _series()
    series.observe([_beat("a", 1_000_000, 0, 0), _beat("b", 1_000_000, 0, 0)])
    series.observe([_beat("a", 1_010_000, 9, 90, ttfts=(0.04,) * 9),
                    _beat("b", 1_010_000, 1, 10, ttfts=(4.0,))])
    sample = series.sample(1_020_000, lag=0)
    assert 25 < sample.ttft_p50_ms <= 50 and sample.ttft_p95_ms > 2_500
    # A minute later with nothing finished, there is no TTFT to draw
    assert series.sample(1_071_000, lag=0).ttft_p50_ms is None



def test_rates_span_the_stated_window_so_waves_of_completions_read_steady() -> None:
    series = _series(interval=1.0)
    # Given a worker finishing a wave of 32 requests (640 tokens) every 8 s, beating each second
    requests = tokens = 0
    table, chart = [], []
    for second in range(0, 181):
        if second and second % 8 == 0:
            requests, tokens = requests + 32, tokens + 640
        series.observe([_beat("a", 1_000_000 + second * 1000, requests, tokens)])
        if second >= 60:
            table.append(series.rates()["default"].requests_per_s)
            chart.append(series.sample(1_000_000 + second * 1000, lag=0).requests_per_s)
    # Then past the first minute, every reading is the true 4 req/s within 15% (two readings a
    # second apart would have been 0 or 32), and the table and chart read the same numbers
    assert all(3.4 <= rate <= 4.6 for rate in table), table
    assert [round(r, 3) for r in table] == chart


def test_a_sample_splits_latency_and_carries_kv_use_and_preemptions() -> None:
    series = _series()
    series.observe([_beat("a", 1_000_000, 0, 0), _beat("b", 1_000_000, 0, 0)])
    # Given requests that waited ~2 s in the queue and then got their first token in ~40 ms
    series.observe([_beat("a", 1_010_000, 9, 90, ttfts=(0.04,) * 9, queued=(2.0,) * 9,
                          kv_usage=0.5, preemptions=3),
                    _beat("b", 1_010_000, 1, 10, ttfts=(0.04,), queued=(2.0,), kv_usage=0.1)])
    sample = series.sample(1_010_000, lag=0)
    # Then queue time and TTFT after admission are told apart
    assert 1_000 < sample.queue_p50_ms <= 2_500 and 25 < sample.ttft_p50_ms <= 50
    # And the KV use is the workers' mean and max, preemptions a rate over the window
    assert (sample.kv_usage, sample.kv_usage_max) == (0.3, 0.5)
    assert sample.preemptions_per_s == 0.3
