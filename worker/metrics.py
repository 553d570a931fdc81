"""WorkerMetrics: the Prometheus series one worker exposes on `/metrics`.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `llmq_time_to_first_token_seconds`,
`vllm:num_requests_running` -> `llmq_num_requests_running`, ...) so existing dashboards need
only a prefix change. Every series carries `model` and `queue` labels; request outcomes add
`finish_reason` (stop | length | cancelled | error) and `error_code` (empty unless error).

Each instance owns a `CollectorRegistry`, so several workers in one process (tests, `llmq up`)
never collide on the global registry. Plain prometheus-client: no engine or torch imports, the
worker feeds numbers in.

References: vLLM `v1/metrics/loggers.py` (names and what they mean), prometheus-client docs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

__all__ = ["WorkerMetrics", "LATENCY_BUCKETS", "TOKEN_LATENCY_BUCKETS"]

# NOTE: CPU inference spans four orders of magnitude: a decode step of the 135M default model
# takes milliseconds, a long prompt's first token or a queued request takes minutes. Buckets run
# from 5 ms to 10 min for request-level latencies and from 1 ms to 10 s for per-token ones.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0, 320.0, 600.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                         1.0, 2.5, 5.0, 10.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

_LABELS = ("model", "queue")


class WorkerMetrics:
    """The counters, gauges and histograms of one worker, bound to its model and queue."""

    def __init__(self, model: str, queue: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        self.queue = queue
        reg = self.registry
        # Resident memory and CPU seconds of the worker process: the numbers to size pods by.
        ProcessCollector(registry=reg)

        self._requests = Counter(
            "llmq_requests", "Requests finished, by finish reason and error code.",
            _LABELS + ("finish_reason", "error_code"), registry=reg)
        prompt_tokens = Counter("llmq_prompt_tokens", "Prompt tokens of finished requests.",
                                _LABELS, registry=reg)
        cached_tokens = Counter(
            "llmq_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache (not recomputed).", _LABELS, registry=reg)
        generation_tokens = Counter("llmq_generation_tokens", "Generated (completion) tokens.",
                                    _LABELS, registry=reg)
        ttft = Histogram("llmq_time_to_first_token_seconds",
                         "First scheduled to the first generated token: TTFT after "
                         "admission, queue time apart (llmq_request_queue_time_seconds).",
                         _LABELS, buckets=LATENCY_BUCKETS, registry=reg)
        itl = Histogram("llmq_inter_token_latency_seconds",
                        "Mean time between generated tokens, one observation per request.",
                        _LABELS, buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        queue_time = Histogram("llmq_request_queue_time_seconds",
                               "Arrival in the queue stream to the first scheduled step.",
                               _LABELS, buckets=LATENCY_BUCKETS, registry=reg)
        e2e = Histogram("llmq_e2e_request_latency_seconds",
                        "Arrival in the queue stream to the terminal event.",
                        _LABELS, buckets=LATENCY_BUCKETS, registry=reg)
        step_time = Histogram("llmq_step_duration_seconds", "Wall time of one engine step.",
                              _LABELS, buckets=TOKEN_LATENCY_BUCKETS, registry=reg)
        step_tokens = Histogram("llmq_step_tokens",
                                "Tokens computed in one engine step (prefill chunks + decodes).",
                                _LABELS, buckets=STEP_TOKEN_BUCKETS, registry=reg)
        running = Gauge("llmq_num_requests_running", "Requests in the running batch.",
                        _LABELS, registry=reg)
        waiting = Gauge("llmq_num_requests_waiting",
                        "Requests read from Redis but not yet scheduled.", _LABELS, registry=reg)
        kv_usage = Gauge("llmq_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1).",
                         _LABELS, registry=reg)
        prefix_hit = Gauge("llmq_prefix_cache_hit_ratio",
                           "Prefix-cache hit rate reported by the KV-cache manager (0-1).",
                           _LABELS, registry=reg)
        preemptions = Counter("llmq_num_preemptions", "Requests preempted for lack of KV blocks.",
                              _LABELS, registry=reg)
        spec_drafts = Counter("llmq_spec_decode_num_drafts",
                              "Speculative drafts verified (one per request per step).",
                              _LABELS, registry=reg)
        spec_draft_tokens = Counter("llmq_spec_decode_num_draft_tokens",
                                    "Draft tokens proposed and verified.", _LABELS, registry=reg)
        spec_accepted_tokens = Counter("llmq_spec_decode_num_accepted_tokens",
                                       "Draft tokens the target model accepted.",
                                       _LABELS, registry=reg)
        steps_paused = Counter("llmq_steps_paused",
                               "Steps with batch work paused between layers for an interactive "
                               "arrival.", _LABELS, registry=reg)
        steps_dropped = Counter("llmq_steps_dropped",
                                "Paused steps dropped (a request of theirs preempted or aborted "
                                "meanwhile) and run again instead of resumed.",
                                _LABELS, registry=reg)
        reclaimed = Counter("llmq_reclaimed_requests",
                            "Requests this worker took over from a dead or stalled peer.",
                            _LABELS, registry=reg)
        dead_letters = Counter("llmq_dead_letters",
                               "Requests this worker moved to the dead-letter stream.",
                               _LABELS, registry=reg)
        self._lost_unread = Counter(
            "llmq_entries_lost_unread",
            "Queue entries trimmed before any worker read them (XADD MAXLEN, XTRIM), seen by "
            "this worker.", _LABELS, registry=reg).labels(model=model, queue=queue)

        # NOTE: children are bound once here, so every series exists (at 0) from the first
        # scrape: `rate()` and alerts see a flat line instead of a missing series.
        labels = {"model": model, "queue": queue}
        self._prompt_tokens = prompt_tokens.labels(**labels)
        self._cached_tokens = cached_tokens.labels(**labels)
        self._generation_tokens = generation_tokens.labels(**labels)
        self._ttft = ttft.labels(**labels)
        self._itl = itl.labels(**labels)
        self._queue_time = queue_time.labels(**labels)
        self._e2e = e2e.labels(**labels)
        self._step_time = step_time.labels(**labels)
        self._step_tokens = step_tokens.labels(**labels)
        self._running = running.labels(**labels)
        self._waiting = waiting.labels(**labels)
        self._kv_usage = kv_usage.labels(**labels)
        self._prefix_hit = prefix_hit.labels(**labels)
        self._preemptions = preemptions.labels(**labels)
        self._reclaimed = reclaimed.labels(**labels)
        self._spec_counters = [c.labels(**labels)
                               for c in (spec_drafts, spec_draft_tokens, spec_accepted_tokens)]
        self._last_spec_totals = [0, 0, 0]
        self._pause_counters = [c.labels(**labels) for c in (steps_paused, steps_dropped)]
        self._last_pause_totals = [0, 0]
        self._dead_letters = dead_letters.labels(**labels)
        for reason in ("stop", "length", "cancelled"):
            self._requests.labels(model=model, queue=queue, finish_reason=reason, error_code="")
        # The engine reports preemptions as a running total; the counter advances by the delta.
        self._last_num_preemptions = 0

    def observe_finished(
        self,
        finish_reason: str,
        error_code: str | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int,
        queue_s: float | None,
        ttft_s: float | None,
        e2e_s: float,
        per_token_s: float | None,
    ) -> None:
        """Record one terminal event. Times a request never reached are None (an invalid
        request has no TTFT; one generated token has no inter-token latency)."""
        self._requests.labels(model=self.model, queue=self.queue, finish_reason=finish_reason,
                              error_code=error_code or "").inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._cached_tokens.inc(cached_prompt_tokens)
        self._generation_tokens.inc(completion_tokens)
        if queue_s is not None:
            self._queue_time.observe(queue_s)
        if ttft_s is not None:
            # NOTE: the wire's TTFT counts from arrival in the stream; the queue time is its
            # own histogram, so this one starts at the first schedule, as vLLM's engine does.
            self._ttft.observe(max(0.0, ttft_s - (queue_s or 0.0)))
        if per_token_s is not None:
            self._itl.observe(per_token_s)
        self._e2e.observe(e2e_s)

    def observe_step(self, duration_s: float, num_tokens: int) -> None:
        self._step_time.observe(duration_s)
        self._step_tokens.observe(num_tokens)

    def set_engine_state(self, running: int, waiting: int, kv_cache_usage: float,
                         prefix_cache_hit_rate: float, num_preemptions_total: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_usage.set(kv_cache_usage)
        self._prefix_hit.set(prefix_cache_hit_rate)
        delta = num_preemptions_total - self._last_num_preemptions
        if delta > 0:
            self._preemptions.inc(delta)
        # A smaller total means a new engine instance restarted its count: follow it from there.
        self._last_num_preemptions = num_preemptions_total

    def set_spec_decode(self, num_drafts_total: int, num_draft_tokens_total: int,
                        num_accepted_tokens_total: int) -> None:
        """Advance the speculative-decoding counters to the engine's running totals."""
        _advance(self._spec_counters, self._last_spec_totals,
                 [num_drafts_total, num_draft_tokens_total, num_accepted_tokens_total])

    def set_step_pauses(self, num_paused_total: int, num_dropped_total: int) -> None:
        """Advance the paused / dropped step counters to the engine's running totals."""
        _advance(self._pause_counters, self._last_pause_totals,
                 [num_paused_total, num_dropped_total])

    def inc_reclaimed(self, n: int = 1) -> None:
        self._reclaimed.inc(n)

    def inc_dead_letters(self, n: int = 1) -> None:
        self._dead_letters.inc(n)

    def inc_lost_unread(self, n: int) -> None:
        """Entries trimmed from the queue before any worker read them (worker/unread_loss.py)."""
        self._lost_unread.inc(n)


def _advance(counters: list[Counter], last: list[int], totals: list[int]) -> None:
    """Counters that follow an engine's running totals: each advances by its total's rise
    (`last` holds the totals seen before); a smaller total means a new engine restarted its
    count, followed from there."""
    for i, (counter, total) in enumerate(zip(counters, totals, strict=True)):
        if total > last[i]:
            counter.inc(total - last[i])
        last[i] = total
