"""EngineStatsLog: one log line of the worker's figures every 10 s while it is busy.

    generation 612.4 tok/s, finished 4.8 req/s, running 32, waiting 12, KV cache 43.1%,
    prefix cache hit rate 12.0%

As vLLM's `LoggingStatLogger` logs throughput, running and waiting requests and KV-cache use
every few seconds: the first thing to read in a worker's log when a job seems slow. Rates are
over the interval since the last line, from the worker's cumulative counts. Nothing is logged
for an interval in which the worker generated nothing and held no request (idle), so an idle
pool's logs stay quiet; the first line after an idle spell covers the interval since the last
check.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmq.worker.engine.engine_core import EngineStats

__all__ = ["EngineStatsLog"]

logger = logging.getLogger("llmq.worker.stats")

INTERVAL_S = 10.0


class EngineStatsLog:
    def __init__(self, now: float, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = (now, 0, 0)  # (time, generated tokens, finished requests)

    def observe(self, now: float, stats: EngineStats | None, generated: int,
                finished: int) -> str | None:
        """Called often (the busy loop's stats tick); logs and returns a line once per
        interval when there was work, else None."""
        then, generated_then, finished_then = self._last
        if now - then < self.interval_s:
            return None
        self._last = (now, generated, finished)
        holding = stats is not None and (stats.num_running or stats.num_waiting)
        if generated == generated_then and finished == finished_then and not holding:
            return None
        seconds = now - then
        line = (f"generation {(generated - generated_then) / seconds:.1f} tok/s, "
                f"finished {(finished - finished_then) / seconds:.1f} req/s")
        if stats is not None:
            line += (f", running {stats.num_running}, waiting {stats.num_waiting}, "
                     f"KV cache {stats.kv_cache_usage:.1%}, "
                     f"prefix cache hit rate {stats.prefix_cache_hit_rate:.1%}")
        logger.info("%s", line)
        return line
