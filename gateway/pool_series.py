"""PoolSeries: the dashboard's charts of the last hour, one sample of the pool per interval.

Every gateway replica watches the workers' heartbeats (through its PoolView, so no extra reads)
and, once per `interval`, offers a sample to the stream `keys.dashboard_series()` under the
interval's own entry id (`llmq.broker.pool_samples`): exactly one replica's sample lands per
interval, with no lock and no leader, and every replica's dashboard reads the same stream and
draws the same chart. The stream is capped to an hour of samples (MAXLEN ~).

Rates come from the cumulative counters of the heartbeats (docs/protocol.md section 9), over a
stated window (RATE_WINDOW_S, one minute): for each worker, the growth of its counters between
its latest heartbeat and the one a minute before, over the time between them; the pool's rate is
the sum over live workers, a queue's over the workers serving it. The queue table and the chart
read the same `rates()`, so they show the same number at the same moment, and a wave of
completions moves it a little instead of reading 0 or a spike (two heartbeats a second apart
would). Latency percentiles (queue time, TTFT after admission, inter-token, end to end) are read
off the merged histograms of the requests that finished within the last minute, so a chart
point never rests on a handful of requests from one interval. KV use is the mean and the max over
live workers at sampling time; preemptions per second come from their counters as rates do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from llmq.broker.aio import AsyncClient
from llmq.broker.exchange import send_async
from llmq.broker.pool_samples import PoolSample, PoolSamples
from llmq.gateway.pool_view import PoolView
from llmq.protocol import LatencyHistogram, WorkerHeartbeat
from llmq.protocol.errors import LLMQError

__all__ = ["RATE_WINDOW_S", "PoolSample", "PoolSeries", "QueueRates"]

logger = logging.getLogger(__name__)

WINDOW_S = 3600  # what the charts show
RATE_WINDOW_S = 60  # the window every rate is computed over
LATENCY_WINDOW_MS = 60_000  # the requests each latency point is computed over
_TICK_S = 1.0  # how often heartbeats are looked at (the pool view reads them anyway)

# heartbeat histogram field -> the sample's field prefix
_LATENCIES = {"queue_hist": "queue", "ttft_admitted_hist": "ttft", "itl_hist": "itl",
              "e2e_hist": "e2e"}


@dataclass(frozen=True)
class QueueRates:
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    preemptions_per_s: float = 0.0


@dataclass(frozen=True)
class _Counts:
    """One heartbeat's cumulative counters."""

    at_ms: int
    requests: int = 0
    tokens: int = 0
    preemptions: int = 0


@dataclass
class _Track:
    """One worker's heartbeats within the rate window (plus the one just before it)."""

    queue: str
    counts: deque[_Counts] = field(default_factory=deque)
    hists: dict[str, LatencyHistogram | None] = field(default_factory=dict)
    kv_usage: float = 0.0

    def rate(self, read: str) -> float:
        first, last = self.counts[0], self.counts[-1]
        if last.at_ms <= first.at_ms:
            return 0.0
        return (getattr(last, read) - getattr(first, read)) * 1000 / (last.at_ms - first.at_ms)


class PoolSeries:
    def __init__(self, client: AsyncClient, pool: PoolView, interval: float) -> None:
        self.client = client
        self.pool = pool
        self.interval_ms = int(interval * 1000)
        self.samples = PoolSamples(client.keys, WINDOW_S * 1000 // self.interval_ms + 2)
        self._tracks: dict[str, _Track] = {}
        # latency name -> (heartbeat ms, counts new in that heartbeat), over the last minute
        self._latency: dict[str, deque[tuple[int, LatencyHistogram]]] = {
            name: deque() for name in _LATENCIES.values()}
        self._watching_since_ms = int(time.time() * 1000)
        self._last_slot = 0

    # -- watching heartbeats (pure, so tests drive it with made-up heartbeats) ----------------

    def observe(self, workers: list[WorkerHeartbeat]) -> None:
        """Take in the workers' latest heartbeats; those gone are forgotten."""
        live = {w.worker_id: w for w in workers}
        for gone in self._tracks.keys() - live.keys():
            del self._tracks[gone]
        for worker_id, beat in live.items():
            counts = _Counts(beat.heartbeat_ms, beat.requests_total, beat.generated_tokens_total,
                             beat.preemptions_total)
            hists = {name: LatencyHistogram.decode(getattr(beat, hist_field))
                     for hist_field, name in _LATENCIES.items()}
            track = self._tracks.get(worker_id)
            if track is None:
                track = self._tracks[worker_id] = _Track(beat.queue)
                # NOTE: a worker started after this replica began watching counted everything
                # since its start where we could see it: its totals are all new.
                if beat.started_ms >= self._watching_since_ms:
                    track.counts.append(_Counts(min(beat.started_ms, beat.heartbeat_ms)))
                    track.hists = dict.fromkeys(hists)
                else:
                    track.counts.append(counts)
                    track.hists = hists
                    track.kv_usage = beat.kv_usage
                    continue
            last = track.counts[-1]
            if beat.heartbeat_ms <= last.at_ms:
                continue
            track.kv_usage = beat.kv_usage
            if counts.requests < last.requests or counts.tokens < last.tokens:
                # NOTE: counters went down: the worker restarted under the same id; what it
                # reports now is new since its last heartbeat.
                track.counts = deque([_Counts(last.at_ms)])
                track.hists = dict.fromkeys(hists)
            for name, hist in hists.items():
                if hist is None:
                    continue
                earlier = track.hists.get(name)
                new = hist if earlier is None else hist.since(earlier)
                if new.total:
                    self._latency[name].append((beat.heartbeat_ms, new))
            track.hists = hists
            track.counts.append(counts)
            # NOTE: one heartbeat at or before the window's start is kept, so a rate spans the
            # whole window rather than whatever part of it the heartbeats fall in.
            window_start = counts.at_ms - RATE_WINDOW_S * 1000
            while len(track.counts) > 2 and track.counts[1].at_ms <= window_start:
                track.counts.popleft()

    def rates(self) -> dict[str, QueueRates]:
        """Tokens, requests and preemptions per second over the rate window, by queue."""
        by_queue: dict[str, QueueRates] = {}
        for track in self._tracks.values():
            seen = by_queue.get(track.queue, QueueRates())
            by_queue[track.queue] = QueueRates(
                seen.tokens_per_s + track.rate("tokens"),
                seen.requests_per_s + track.rate("requests"),
                seen.preemptions_per_s + track.rate("preemptions"))
        return by_queue

    def sample(self, now_ms: int, lag: int) -> PoolSample:
        figures: dict[str, float | None] = {}
        for name, recent in self._latency.items():
            while recent and recent[0][0] < now_ms - LATENCY_WINDOW_MS:
                recent.popleft()
            merged = LatencyHistogram.merged(h for _, h in recent)
            for q, label in ((0.5, "p50"), (0.95, "p95")):
                value = merged.quantile(q)
                figures[f"{name}_{label}_ms"] = None if value is None else round(value, 1)
        rates = self.rates().values()
        kv = [t.kv_usage for t in self._tracks.values()]
        return PoolSample(
            t=now_ms - now_ms % self.interval_ms,
            tokens_per_s=round(sum(r.tokens_per_s for r in rates), 2),
            requests_per_s=round(sum(r.requests_per_s for r in rates), 3), lag=lag,
            preemptions_per_s=round(sum(r.preemptions_per_s for r in rates), 3),
            kv_usage=round(sum(kv) / len(kv), 4) if kv else None,
            kv_usage_max=round(max(kv), 4) if kv else None, **figures)

    # -- the stream ---------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Watch heartbeats every second; once per interval, offer a sample."""
        failing = False
        while True:
            try:
                self.observe(await self.pool.workers())
                now_ms = int(time.time() * 1000)
                slot = now_ms - now_ms % self.interval_ms
                # NOTE: not before a whole interval of watching: rates need two heartbeats.
                if slot > self._last_slot and now_ms - self._watching_since_ms >= \
                        self.interval_ms:
                    self._last_slot = slot
                    await self.offer(self.sample(now_ms, await self._total_lag()))
                if failing:
                    logger.info("sampling the pool for the dashboard works again")
                failing = False
            except LLMQError as exc:
                # NOTE: said once per outage, not every second: the charts just have a gap.
                if not failing:
                    logger.warning("sampling the pool for the dashboard failed: %s", exc)
                failing = True
            await asyncio.sleep(_TICK_S)

    async def _total_lag(self) -> int:
        total = 0
        for queue in await self.client.queues():
            stats = await self.client.stats(queue)
            total += stats.lag if stats.lag is not None else stats.length - stats.pending
        return total

    async def offer(self, sample: PoolSample) -> bool:
        """Add the sample under its interval's id; False when another replica was first."""
        return await send_async(self.client, self.samples.offer(sample))

    async def read(self, since_ms: int = 0) -> list[PoolSample]:
        """The samples of the last hour after `since_ms`, oldest first."""
        start = max(since_ms + 1, int(time.time() * 1000) - WINDOW_S * 1000)
        return await send_async(self.client, self.samples.since(start))

