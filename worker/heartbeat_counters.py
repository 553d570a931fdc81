"""HeartbeatCounters: what a worker counts for its heartbeat, from its start on.

Finished requests and their time to first token, for the gateway's charts (docs/protocol.md
section 9): the heartbeat carries totals, never rates, so a reader gets the rate over any
window by subtracting two heartbeats, and several workers' counts simply add up. The result
writer thread counts a request once its terminal event is written; the lease keeper's thread
reads a snapshot for each heartbeat.
"""

from __future__ import annotations

import threading

from llmq.protocol import LatencyHistogram

__all__ = ["HeartbeatCounters"]


class HeartbeatCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests_total = 0
        self._ttft = LatencyHistogram()

    def add_finished(self, ttfts_s: list[float | None]) -> None:
        """Requests whose terminal event was written: their TTFTs (None: no token came)."""
        with self._lock:
            self._requests_total += len(ttfts_s)
            for ttft in ttfts_s:
                if ttft is not None:
                    self._ttft.observe(ttft)

    def snapshot(self) -> tuple[int, str]:
        """(requests_total, ttft_hist) as the heartbeat writes them."""
        with self._lock:
            return self._requests_total, self._ttft.encode()
