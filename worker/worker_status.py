"""WorkerStatus: what a worker tells the world about itself, from the busy loop's snapshots.

Every quarter second the busy loop snapshots the engine's state (`publish`): the stats log, the
Prometheus gauges and /readyz are refreshed from it, and cache affinity learns what is cached.
The lease keeper's thread reads the latest snapshot for each heartbeat (`heartbeat_fields`), so
no other thread ever calls into the engine.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from llmq import protocol
from llmq.protocol.records import MAX_LISTED_LORAS
from llmq.worker.stats_log import EngineStatsLog

if TYPE_CHECKING:
    from llmq.worker.affinity_keeper import AffinityKeeper
    from llmq.worker.engine.engine_core import EngineStats
    from llmq.worker.engine_client import EngineClient
    from llmq.worker.health_server import HealthServer
    from llmq.worker.metrics import WorkerMetrics
    from llmq.worker.worker_context import WorkerContext


class WorkerStatus:
    def __init__(self, ctx: WorkerContext, engine: EngineClient, metrics: WorkerMetrics | None,
                 health: HealthServer | None) -> None:
        self.ctx = ctx
        self.engine = engine
        self.metrics = metrics
        self.health = health
        self.started_ms = int(time.time() * 1000)
        self.num_generated = 0  # output tokens since start (the busy loop adds each step's)
        self._rate = (time.monotonic(), 0)
        self._stats: EngineStats | None = None
        self.stats_log = EngineStatsLog(time.monotonic())

    def publish(self, affinity: AffinityKeeper | None, not_ready: str | None) -> None:
        """Snapshot the engine's state; beat, refresh the gauges and readiness (`not_ready`
        names why the worker takes no work, beside Redis being unreachable)."""
        self._stats = s = self.engine.stats()
        if affinity is not None:
            affinity.note_cache(self.engine.prefix_landmarks())
        self.stats_log.observe(time.monotonic(), s, self.num_generated,
                               self.ctx.counters.requests_total)
        if self.health is None or self.metrics is None:
            return
        self.health.beat()
        self.metrics.set_engine_state(s.num_running, s.num_waiting, s.kv_cache_usage,
                                      s.prefix_cache_hit_rate, s.num_preemptions)
        self.metrics.set_spec_decode(s.spec_num_drafts, s.spec_num_draft_tokens,
                                     s.spec_num_accepted_tokens)
        self.metrics.set_step_pauses(s.num_steps_paused, s.num_steps_dropped)
        if not_ready is not None:
            self.health.set_ready(False, not_ready)
            return
        down = self.ctx.state.down()
        self.health.set_ready(not down, "Redis unreachable from " + ", ".join(down)
                              if down else "ready")

    def heartbeat_fields(self, draining: bool, sleep_level: int) -> dict[str, str]:
        """The heartbeat hash, from the latest snapshot (called on the lease keeper's thread)."""
        now = time.monotonic()
        last_t, last_n = self._rate
        generated = self.num_generated
        rate = (generated - last_n) / (now - last_t) if now > last_t else 0.0
        self._rate = (now, generated)
        s = self._stats
        config = self.ctx.config
        heartbeat = protocol.WorkerHeartbeat(
            worker_id=config.worker_id, queue=config.queue, model=self.ctx.model_name,
            pid=os.getpid(), host=os.uname().nodename, started_ms=self.started_ms,
            heartbeat_ms=int(time.time() * 1000),
            running=s.num_running if s else 0, waiting=s.num_waiting if s else 0,
            kv_usage=round(s.kv_cache_usage, 4) if s else 0.0, tokens_per_s=round(rate, 2),
            draining=int(draining),
            prefix_cache_hit_rate=round(s.prefix_cache_hit_rate, 4) if s else 0.0,
            generated_tokens_total=generated, sleeping=sleep_level,
            preemptions_total=s.num_preemptions if s else 0,
            speculative_method=self.engine.config.speculative_method or "",
            spec_acceptance_rate=round(s.spec_acceptance_rate, 4) if s else 0.0)
        if (loras := self.engine.loras) is not None:
            heartbeat.loras_loaded = ",".join(loras.loaded())
            heartbeat.loras_available = ",".join(loras.available()[:MAX_LISTED_LORAS])
        return protocol.encode_heartbeat(self.ctx.counters.fill(heartbeat))


def start_observability(metrics_port: int, model_name: str, queue_name: str
                        ) -> tuple[WorkerMetrics | None, HealthServer | None]:
    """(WorkerMetrics, HealthServer) serving /metrics /healthz /readyz, or (None, None) when
    `metrics_port` is 0. Not ready until the busy loop says so."""
    if not metrics_port:
        return None, None
    from llmq.worker.health_server import HealthServer
    from llmq.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics(model_name or "default", queue_name)
    health = HealthServer(metrics_port, metrics)
    health.set_ready(False, "loading model")
    return metrics, health
