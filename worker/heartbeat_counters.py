"""HeartbeatCounters: what a worker counts for its heartbeat, from its start on.

Finished requests, their tokens, finish reasons and latencies, for the gateway's charts and its
pool-wide `/metrics` (docs/protocol.md section 9): the heartbeat carries totals, never rates, so
a reader gets the rate over any window by subtracting two heartbeats, and several workers' counts
simply add up. The result writer thread counts a request once its terminal event is written;
the lease keeper's thread reads a snapshot for each heartbeat.

The latencies are split as vLLM splits them: queue time (arrival in the stream to first
scheduled), TTFT after admission (first scheduled to first token), inter-token latency and end
to end; `ttft_hist` keeps the older whole TTFT (arrival to first token) for readers that use it.
"""

from __future__ import annotations

import threading

import msgspec

from llmq.protocol import LatencyHistogram, Timings, Usage, WorkerHeartbeat

__all__ = ["FINISH_REASONS", "HeartbeatCounters"]

# The finish reasons counted apart; any other a request ends with counts as `stop`.
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class HeartbeatCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests_total = 0
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._finished = dict.fromkeys(FINISH_REASONS, 0)
        self._ttft = LatencyHistogram()
        self._queue = LatencyHistogram()
        self._ttft_admitted = LatencyHistogram()
        self._itl = LatencyHistogram()
        self._e2e = LatencyHistogram()

    def add_finished(self, finished: list[tuple[str, Usage, Timings]], num_errors: int = 0
                     ) -> None:
        """Requests whose terminal event was written: (finish reason, usage, timings) of each,
        and how many were refused before they ran (admission errors, no figures)."""
        with self._lock:
            self._requests_total += len(finished) + num_errors
            self._finished["error"] += num_errors
            for reason, usage, timings in finished:
                self._finished[reason if reason in self._finished else "stop"] += 1
                self._prompt_tokens += usage.prompt_tokens
                self._cached_prompt_tokens += usage.cached_prompt_tokens
                self._queue.observe(timings.queue)
                self._e2e.observe(timings.e2e)
                if timings.ttft is not None:
                    self._ttft.observe(timings.ttft)
                    self._ttft_admitted.observe(max(0.0, timings.ttft - timings.queue))
                if timings.per_token is not None:
                    self._itl.observe(timings.per_token)

    @property
    def requests_total(self) -> int:
        with self._lock:
            return self._requests_total

    def fill(self, heartbeat: WorkerHeartbeat) -> WorkerHeartbeat:
        """The heartbeat with every counter set, under its `WorkerHeartbeat` field name."""
        with self._lock:
            return msgspec.structs.replace(heartbeat, **{
                "requests_total": self._requests_total,
                "ttft_hist": self._ttft.encode(),
                "prompt_tokens_total": self._prompt_tokens,
                "cached_prompt_tokens_total": self._cached_prompt_tokens,
                **{f"finished_{reason}_total": n for reason, n in self._finished.items()},
                "queue_hist": self._queue.encode(with_sum=True),
                "ttft_admitted_hist": self._ttft_admitted.encode(with_sum=True),
                "itl_hist": self._itl.encode(with_sum=True),
                "e2e_hist": self._e2e.encode(with_sum=True),
            })
