"""`llmq worker`: serve one queue with an engine core (the worker process of the pool).

Flags map 1:1 onto `WorkerConfig` and `EngineConfig` fields, each with its `LLMQ_*` variable.
torch and the engine are imported inside the command only, so `llmq --help` stays light.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from typing import Any

import click

from llmq.broker import tracing
from llmq.cli.options import connection_options, engine_config_kwargs, engine_options
from llmq.cli.tracing_option import otlp_traces_endpoint_option, start_tracing
from llmq.worker.startup_gc import startup_gc


def parse_cpus(value: str | None) -> set[int] | None:
    """'0,2-3' -> {0, 2, 3}; None or '' -> None."""
    if not value:
        return None
    cpus: set[int] = set()
    try:
        for part in value.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise click.BadParameter(f"expected cores like 0 or 2-3,5, got {value!r}") from None
    return cpus


@click.command()
@connection_options
@click.option("--worker-id", envvar="LLMQ_WORKER_ID", default=None,
              help="Consumer name (default: host-pid-random).")
@click.option("--lease-timeout", envvar="LLMQ_LEASE_TIMEOUT", type=click.FloatRange(min=0,
              min_open=True), default=30.0, show_default=True,
              help="Seconds without renewal before peers reclaim a request.")
@click.option("--renew-interval", envvar="LLMQ_RENEW_INTERVAL",
              type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds between lease renewals (default: lease timeout / 3).")
@click.option("--heartbeat-timeout", envvar="LLMQ_HEARTBEAT_TIMEOUT",
              type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds without a heartbeat after which a worker is dead and peers take "
                   "its requests at once.")
@click.option("--claim-interval", envvar="LLMQ_CLAIM_INTERVAL",
              type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds between scans for dead workers' requests (default: heartbeat "
                   "timeout / 5).")
@click.option("--drain-timeout", envvar="LLMQ_DRAIN_TIMEOUT", type=click.FloatRange(min=0),
              default=20.0, show_default=True,
              help="Seconds to finish in-flight requests after SIGTERM before handing them back.")
@click.option("--max-deliveries", envvar="LLMQ_MAX_DELIVERIES", type=click.IntRange(min=1),
              default=3, show_default=True,
              help="Deliveries before a request is dead-lettered as poison.")
@click.option("--result-ttl", envvar="LLMQ_RESULT_TTL", type=click.IntRange(min=1),
              default=24 * 3600, show_default=True,
              help="Seconds a result stream lives after its last event.")
@click.option("--result-maxlen", envvar="LLMQ_RESULT_MAXLEN", type=click.IntRange(min=1),
              default=10_000, show_default=True, help="Approximate cap of each result stream.")
@click.option("--metrics-port", envvar="LLMQ_METRICS_PORT", type=click.IntRange(0, 65535),
              default=0, show_default=True, help="/metrics /healthz /readyz port (0: off).")
@click.option("--interactive-headroom", envvar="LLMQ_INTERACTIVE_HEADROOM",
              type=click.FloatRange(0, 1, max_open=True), default=0.25, show_default=True,
              help="Fraction of the engine's seats batch-lane work leaves free for interactive "
                   "requests.")
@click.option("--even-share/--no-even-share", envvar="LLMQ_EVEN_SHARE", default=True,
              show_default=True,
              help="While requests wait unread, hold at most an even part of the queue's work "
                   "among its live workers (off for a pool of workers of different speeds: "
                   "docs/operations.md).")
@click.option("--tenant-weights", envvar="LLMQ_TENANT_WEIGHTS", default="",
              help="Fair-share weights of tenants within a lane, e.g. acme=2,bob=1 (others 1).")
@click.option("--cpus", envvar="LLMQ_CPUS", default=None, callback=lambda _c, _p, v: parse_cpus(v),
              help="Cores to run on, e.g. 0 or 2-3,5 (default: any). `llmq up` pins each "
              "worker to its own.")
@otlp_traces_endpoint_option
@click.option("--affinity/--no-affinity", envvar="LLMQ_AFFINITY", default=True,
              show_default=True,
              help="Prefix-cache affinity: hand a request whose prefix a peer's cache holds to "
              "that peer (docs/performance.md).")
@click.option("--affinity-steal-delay", envvar="LLMQ_AFFINITY_STEAL_DELAY",
              type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds a request handed to a busy peer waits before an idle worker takes "
              "it anyway.")
@click.option("--affinity-min-tokens", envvar="LLMQ_AFFINITY_MIN_TOKENS",
              type=click.IntRange(min=1), default=256, show_default=True,
              help="Prefix tokens a peer's cache must hold beyond this worker's for a request "
              "to go there.")
@engine_options
def worker(redis_url: str | None, prefix: str, queue: str, worker_id: str | None,
           lease_timeout: float, renew_interval: float | None, heartbeat_timeout: float,
           claim_interval: float | None,
           drain_timeout: float, max_deliveries: int, result_ttl: int, result_maxlen: int,
           metrics_port: int, interactive_headroom: float, even_share: bool,
           tenant_weights: str,
           cpus: set[int] | None, otlp_traces_endpoint: str | None,
           affinity: bool, affinity_steal_delay: float, affinity_min_tokens: int,
           **kwargs: Any) -> None:
    """Serve QUEUE: read requests from Redis, generate, stream tokens back."""
    if cpus:
        # NOTE: before torch starts its threads: they inherit the process's affinity.
        os.sched_setaffinity(0, cpus)
    with startup_gc():  # no cyclic GC while torch is imported and the model loaded
        from llmq.broker.connection import resolve_redis_url
        from llmq.protocol.errors import LLMQError
        from llmq.worker.engine.config import EngineConfig
        from llmq.worker.worker_config import WorkerConfig, default_worker_id

        try:
            engine_config = EngineConfig(**engine_config_kwargs(kwargs))
            config = WorkerConfig(
                redis_url=resolve_redis_url(redis_url), prefix=prefix, queue=queue,
                worker_id=worker_id or default_worker_id(), lease_timeout=lease_timeout,
                renew_interval=renew_interval, heartbeat_timeout=heartbeat_timeout,
                claim_interval=claim_interval,
                drain_timeout=drain_timeout, max_deliveries=max_deliveries, result_ttl=result_ttl,
                result_maxlen=result_maxlen, metrics_port=metrics_port,
                interactive_headroom=interactive_headroom, even_share=even_share,
                tenant_weights=tenant_weights,
                affinity=affinity, affinity_steal_delay=affinity_steal_delay,
                affinity_min_tokens=affinity_min_tokens)
        except LLMQError as e:
            raise click.ClickException(str(e)) from None
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

        from llmq.worker.engine.engine_core import EngineCore
        from llmq.worker.worker import Worker
        from llmq.worker.worker_status import start_observability

        # NOTE: `kill -USR1 <pid>` prints every thread's stack to stderr: the first thing to look
        # at when a worker seems stuck.
        faulthandler.register(signal.SIGUSR1, all_threads=True)

        model_name = os.path.basename(engine_config.model.rstrip("/")) or "SmolLM2-135M-Instruct"
        from llmq.worker.health_server import MetricsPortInUse

        try:
            observability = start_observability(metrics_port, model_name, queue)
        except MetricsPortInUse as e:
            raise click.ClickException(e.strerror or str(e)) from None
        start_tracing("llmq-worker", otlp_traces_endpoint)
        try:
            engine = EngineCore(engine_config)
        except ValueError as e:  # a model or draft model that cannot be served (docs/models.md)
            raise click.ClickException(str(e)) from None
    code = Worker(config, engine, model_name=model_name, observability=observability).run()
    # NOTE: everything is written and handed back by now; the interpreter's own teardown of
    # torch and the model (about a second) would only push the exit past the drain budget.
    tracing.shutdown()  # the spans still buffered: os._exit skips the exporter's own exit hook
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
