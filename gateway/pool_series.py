"""PoolSeries: the dashboard's charts of the last hour, one sample of the pool per interval.

Every gateway replica watches the workers' heartbeats (through its PoolView, so no extra reads)
and, once per `interval`, offers a sample to the stream `keys.dashboard_series()` under the
interval's own entry id (`llmq.broker.pool_samples`): exactly one replica's sample lands per
interval, with no lock and no leader, and every replica's dashboard reads the same stream and
draws the same chart. The stream is capped to an hour of samples (MAXLEN ~).

Rates come from the cumulative counters of the heartbeats (docs/protocol.md section 9): for each
worker, the difference between its two latest heartbeats over the time between them; the pool's
rate is the sum over live workers, a queue's over the workers serving it. TTFT p50/p95 are read
off the merged histogram of the requests that finished within the last minute, so a chart
point never rests on a handful of requests from one interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from llmq.broker.aio import AsyncClient
from llmq.broker.exchange import send_async
from llmq.broker.pool_samples import PoolSample, PoolSamples
from llmq.gateway.pool_view import PoolView
from llmq.protocol import LatencyHistogram, WorkerHeartbeat
from llmq.protocol.errors import LLMQError

__all__ = ["PoolSample", "PoolSeries", "QueueRates"]

logger = logging.getLogger(__name__)

WINDOW_S = 3600  # what the charts show
TTFT_WINDOW_MS = 60_000  # the requests each TTFT point is computed over
_TICK_S = 1.0  # how often heartbeats are looked at (the pool view reads them anyway)


@dataclass(frozen=True)
class QueueRates:
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0


@dataclass
class _Track:
    """One worker's latest heartbeat counters and the rates between its last two heartbeats."""

    queue: str
    heartbeat_ms: int
    requests_total: int
    tokens_total: int
    ttft: LatencyHistogram | None
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0


class PoolSeries:
    def __init__(self, client: AsyncClient, pool: PoolView, interval: float) -> None:
        self.client = client
        self.pool = pool
        self.interval_ms = int(interval * 1000)
        self.samples = PoolSamples(client.keys, WINDOW_S * 1000 // self.interval_ms + 2)
        self._tracks: dict[str, _Track] = {}
        self._ttft: deque[tuple[int, LatencyHistogram]] = deque()  # (heartbeat ms, new counts)
        self._watching_since_ms = int(time.time() * 1000)
        self._last_slot = 0

    # -- watching heartbeats (pure, so tests drive it with made-up heartbeats) ----------------

    def observe(self, workers: list[WorkerHeartbeat]) -> None:
        """Take in the workers' latest heartbeats; those gone are forgotten."""
        live = {w.worker_id: w for w in workers}
        for gone in self._tracks.keys() - live.keys():
            del self._tracks[gone]
        for worker_id, beat in live.items():
            track = self._tracks.get(worker_id)
            ttft = LatencyHistogram.decode(beat.ttft_hist)
            if track is None:
                # NOTE: a worker started after this replica began watching counted everything
                # since its start where we could see it: its totals are all new.
                if beat.started_ms >= self._watching_since_ms:
                    track = _Track(beat.queue, beat.started_ms, 0, 0, None)
                else:
                    self._tracks[worker_id] = _Track(beat.queue, beat.heartbeat_ms,
                                                     beat.requests_total,
                                                     beat.generated_tokens_total, ttft)
                    continue
            if beat.heartbeat_ms <= track.heartbeat_ms:
                continue
            seconds = (beat.heartbeat_ms - track.heartbeat_ms) / 1000.0
            # NOTE: a counter below the last one is a worker restarted under the same id.
            new_requests = _since(beat.requests_total, track.requests_total)
            new_tokens = _since(beat.generated_tokens_total, track.tokens_total)
            if ttft is not None:
                new_ttft = ttft if track.ttft is None else ttft.since(track.ttft)
                if new_ttft.total:
                    self._ttft.append((beat.heartbeat_ms, new_ttft))
            self._tracks[worker_id] = _Track(beat.queue, beat.heartbeat_ms, beat.requests_total,
                                             beat.generated_tokens_total, ttft,
                                             new_requests / seconds, new_tokens / seconds)

    def rates(self) -> dict[str, QueueRates]:
        """Tokens and requests per second by queue, from the workers serving it."""
        by_queue: dict[str, QueueRates] = {}
        for track in self._tracks.values():
            seen = by_queue.get(track.queue, QueueRates())
            by_queue[track.queue] = QueueRates(seen.tokens_per_s + track.tokens_per_s,
                                               seen.requests_per_s + track.requests_per_s)
        return by_queue

    def sample(self, now_ms: int, lag: int) -> PoolSample:
        while self._ttft and self._ttft[0][0] < now_ms - TTFT_WINDOW_MS:
            self._ttft.popleft()
        ttft = LatencyHistogram.merged(h for _, h in self._ttft)
        rates = self.rates().values()
        p50, p95 = ttft.quantile(0.5), ttft.quantile(0.95)
        return PoolSample(
            t=now_ms - now_ms % self.interval_ms,
            tokens_per_s=round(sum(r.tokens_per_s for r in rates), 2),
            requests_per_s=round(sum(r.requests_per_s for r in rates), 3), lag=lag,
            ttft_p50_ms=None if p50 is None else round(p50, 1),
            ttft_p95_ms=None if p95 is None else round(p95, 1))

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


def _since(now: int, then: int) -> int:
    return now - then if now >= then else now
