"""LatencyHistogram: time-to-first-token counts in fixed buckets, carried by heartbeats.

A worker counts every finished request's TTFT into these buckets from the moment it starts and
writes the counts into its heartbeat hash (`ttft_hist`, comma-separated, one count per bucket);
the gateway subtracts two heartbeats of a worker to get the requests in between, adds those up
over the pool, and reads percentiles off the sum. Counts add across workers where percentiles
do not, which is why the wire carries counts (Prometheus' `histogram_quantile` does the same).

The other latencies of a heartbeat (queue time, TTFT after admission, inter-token, end to end)
also carry the sum of what was observed, after a `;` (`encode(with_sum=True)`), so the gateway can
expose them as Prometheus histograms with `_sum` and `_count`; a reader that finds no `;` takes the
sum as 0.

Bounds run from 10 ms to 10 min, upper bounds in ms; the last bucket is everything above.
Percentiles are interpolated inside the bucket they fall in, so they are as exact as the
bucket is narrow (about 2.5x apart): enough for a chart, not for an SLO report (use the
worker's Prometheus histogram for that).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

__all__ = ["TTFT_BUCKETS_MS", "LatencyHistogram"]

TTFT_BUCKETS_MS: tuple[float, ...] = (10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000,
                                      30_000, 60_000, 120_000, 600_000)


class LatencyHistogram:
    """Counts per bucket of `TTFT_BUCKETS_MS` plus one overflow bucket (not thread-safe)."""

    def __init__(self, counts: Sequence[int] | None = None, sum_s: float = 0.0) -> None:
        size = len(TTFT_BUCKETS_MS) + 1
        self.counts = list(counts) if counts is not None else [0] * size
        self.sum_s = sum_s  # seconds: the sum of what was observed
        if len(self.counts) != size or any(c < 0 for c in self.counts):
            raise ValueError(f"a latency histogram has {size} non-negative counts")

    @property
    def total(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TTFT_BUCKETS_MS, seconds * 1000.0)] += 1
        self.sum_s += seconds

    def encode(self, *, with_sum: bool = False) -> str:
        counts = ",".join(map(str, self.counts))
        return f"{counts};{self.sum_s:.6f}" if with_sum else counts

    @classmethod
    def decode(cls, text: str) -> LatencyHistogram | None:
        """The histogram of a heartbeat's field; None for an empty or unreadable one."""
        counts, _, total = text.partition(";")
        try:
            return cls([int(c) for c in counts.split(",")], float(total or 0)) if text else None
        except ValueError:
            return None

    def since(self, earlier: LatencyHistogram) -> LatencyHistogram:
        """What was counted after `earlier` (of the same worker); a reset one counts whole."""
        delta = [now - then for now, then in zip(self.counts, earlier.counts, strict=True)]
        if any(d < 0 for d in delta):
            return LatencyHistogram(self.counts, self.sum_s)
        return LatencyHistogram(delta, max(0.0, self.sum_s - earlier.sum_s))

    @classmethod
    def merged(cls, histograms: Iterable[LatencyHistogram]) -> LatencyHistogram:
        total = cls()
        for histogram in histograms:
            total.counts = [a + b for a, b in zip(total.counts, histogram.counts, strict=True)]
            total.sum_s += histogram.sum_s
        return total

    def quantile(self, q: float) -> float | None:
        """The q-quantile in ms (linear inside its bucket); None when nothing was counted."""
        total = self.total
        if not total:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.counts):
            if count and seen + count >= rank:
                low = TTFT_BUCKETS_MS[index - 1] if index else 0.0
                if index == len(TTFT_BUCKETS_MS):
                    return low  # above the last bound: all that can be said
                return low + (TTFT_BUCKETS_MS[index] - low) * (rank - seen) / count
            seen += count
        return TTFT_BUCKETS_MS[-1]
