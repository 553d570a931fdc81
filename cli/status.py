"""`llmq status`: the queues (length, lag, pending, dead letters), their lanes (backlog,
running, done, done per second over one second: broker/lane_stats.py) and the live workers.

PREFIX HIT is the share of prompt tokens served from a prefix cache since each worker started
(its heartbeat's cached over prompt token totals): per worker, and per queue over its live
workers together, the figure prefix-cache affinity raises (worker/affinity_keeper.py).

CONSUMERS counts the queue's live workers (those with a heartbeat), not every consumer name the
group still knows: a stopped worker's name stays until a peer's reclaimer removes it (once it
holds nothing), and counting it would show six consumers for two workers after three restarts.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import click
import msgspec

from llmq.broker.commands import exhausted_message
from llmq.broker.connection import redact_url
from llmq.broker.lane_stats import LaneStats
from llmq.broker.redis_url import primary_address
from llmq.broker.work_lanes import INTERACTIVE
from llmq.cli.helpers import ago, echo_json, open_client, table
from llmq.cli.options import connection_kwargs, connection_options
from llmq.protocol import WorkerHeartbeat

# Seconds between the two snapshots a lane's throughput (DONE/S) is measured over.
RATE_WINDOW_S = 1.0


def _lane_rates(before: list[LaneStats], after: list[LaneStats], seconds: float
                ) -> dict[tuple[str, str], float]:
    """Requests finished per second in each lane between two snapshots."""
    earlier = {(s.queue, s.lane): s.done for s in before}
    rates = {}
    for s in after:
        done, then = s.done, earlier.get((s.queue, s.lane))
        if done is not None and then is not None and seconds > 0:
            rates[(s.queue, s.lane)] = max(0, done - then) / seconds
    return rates


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@connection_options
def status(as_json: bool, **kwargs: Any) -> None:
    """Show every queue and every live worker."""
    client = open_client(**connection_kwargs(kwargs))
    names = client.queues()
    if client.settings.queue not in names:
        names.append(client.settings.queue)  # the configured queue, even before it exists
    queues = [client.stats(name) for name in sorted(names)]
    lanes_before = [s for name in sorted(names) for s in client.lane_stats(name)]
    started = time.monotonic()
    time.sleep(RATE_WINDOW_S)  # NOTE: two snapshots: a lane's throughput is their difference
    lanes = [s for name in sorted(names) for s in client.lane_stats(name)]
    rates = _lane_rates(lanes_before, lanes, time.monotonic() - started)
    workers = sorted(client.workers(), key=lambda w: (w.queue, w.worker_id))
    live = Counter(w.queue for w in workers)
    now = time.time()
    primary = primary_address(client.redis)
    pool_hit = {q.queue: hit_rate([w for w in workers if w.queue == q.queue]) for q in queues}
    if as_json:
        echo_json({
            "redis_url": redact_url(client.url),
            "primary": primary,
            "queues": [{"queue": q.queue, "length": q.length, "lag": q.lag,
                        "pending": q.pending, "dead_letters": q.dead_letters,
                        "consumers": live[q.queue], "group_consumers": q.consumers,
                        "exhausted": q.exhausted, "lost_unread": q.lost_unread,
                        "prefix_hit_rate": pool_hit[q.queue]} for q in queues],
            "lanes": [{"queue": s.queue, "lane": s.lane, "tenant": s.tenant,
                       "priority_class": s.priority_class, "backlog": s.backlog,
                       "pending": s.pending, "done": s.done,
                       "done_per_s": rates.get((s.queue, s.lane))} for s in lanes],
            "workers": [{**msgspec.structs.asdict(w),
                         "heartbeat_age_s": round(max(0.0, now - w.heartbeat_ms / 1000), 3),
                         "prefix_hit_rate_total": hit_rate([w])}
                        for w in workers],
        })
        return
    if primary is not None:
        click.echo(f"Sentinel primary: {primary}")
    click.echo(table(
        ["QUEUE", "LENGTH", "LAG", "PENDING", "DEAD LETTERS", "CONSUMERS", "PREFIX HIT"],
        [[q.queue, q.length, "?" if q.lag is None else q.lag, q.pending, q.dead_letters,
          live[q.queue], percent(pool_hit[q.queue])] for q in queues]))
    if any(s.lane != INTERACTIVE or s.length for s in lanes):
        click.echo("")
        click.echo(table(
            ["QUEUE", "LANE", "BACKLOG", "RUNNING", "DONE", "DONE/S"],
            [[s.queue, s.lane, s.backlog, s.pending, "?" if s.done is None else s.done,
              "?" if (rate := rates.get((s.queue, s.lane))) is None else f"{rate:.1f}"]
             for s in lanes]))
    for q in queues:
        if q.exhausted:
            click.echo(f"\nqueue {q.queue!r} is FULL: {exhausted_message(client.keys, q.queue)}")
        if q.lost_unread:
            click.echo(f"\nqueue {q.queue!r}: {q.lost_unread} entries were trimmed before any "
                       "worker read them (XADD MAXLEN / XTRIM by a producer credential); see "
                       "`llmq dlq` and docs/operations.md")
    click.echo("")
    if not workers:
        click.echo("no live workers (start some with `llmq up` or `llmq worker`)")
        return
    click.echo(table(
        ["WORKER", "QUEUE", "MODEL", "STATE", "RUNNING", "WAITING", "KV USE", "TOKENS/S",
         "PREFIX HIT", "SPEC ACCEPT", "LORAS", "HEARTBEAT"],
        [[w.worker_id, w.queue, w.model,
          f"sleeping (level {w.sleeping})" if w.sleeping else "serving", w.running, w.waiting,
          f"{w.kv_usage:.0%}", f"{w.tokens_per_s:.1f}", percent(hit_rate([w])),
          f"{w.spec_acceptance_rate:.0%} {w.speculative_method}" if w.speculative_method
          else "off", _loras(w.loras_loaded, w.loras_available), ago(w.heartbeat_ms, now)]
         for w in workers]))


def _loras(loaded: str, available: str) -> str:
    """`a,b (2 of 5)`: the adapters in memory, of those the worker's --lora-dir holds."""
    if not available and not loaded:
        return "-"
    names = [n for n in loaded.split(",") if n]
    return f"{','.join(names) or 'none'} ({len(names)} of {len(available.split(','))})"


def hit_rate(workers: list[WorkerHeartbeat]) -> float | None:
    """Prompt tokens served from the prefix cache over all prompt tokens, since these workers
    started; None before any finished a request."""
    prompt = sum(w.prompt_tokens_total for w in workers)
    return sum(w.cached_prompt_tokens_total for w in workers) / prompt if prompt else None


def percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"
